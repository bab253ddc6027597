"""Puts OpenAI's o200k_base vocabulary where openai-harmony finds it offline: the harmony
reference test (tests/prompts/test_harmony_reference.py) renders gpt-oss conversations with it.

openai-harmony downloads the vocabulary from OpenAI's blob store at first use, which no machine
here reaches; PyPI's litellm wheel ships the same file (checked by its sha256, the hash
openai-harmony itself expects), so setup takes that one member and leaves the package out.
Writes <venv>/share/o200k/o200k_base.tiktoken; point TIKTOKEN_ENCODINGS_BASE at that folder.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "litellm==1.110.2"
MEMBER = "litellm/litellm_core_utils/tokenizers/fb374d419588a4632f3f557e76b4b70aebbca790"
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
TARGET = Path(sys.prefix) / "share" / "o200k" / "o200k_base.tiktoken"


def main() -> None:
    if TARGET.exists() and hashlib.sha256(TARGET.read_bytes()).hexdigest() == SHA256:
        return
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", folder], check=True)
        (wheel,) = Path(folder).glob("*.whl")
        data = zipfile.ZipFile(wheel).read(MEMBER)
    if hashlib.sha256(data).hexdigest() != SHA256:
        raise SystemExit(f"{WHEEL}'s {MEMBER} is not o200k_base (sha256 differs from {SHA256})")
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_bytes(data)


if __name__ == "__main__":
    main()
