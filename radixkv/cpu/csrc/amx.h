/* AMX tiles (Sapphire Rapids and later): detection, the tile configuration record and the
 * one-time permission request, shared by the kernels that use tiles. */
#ifndef RADIXKV_AMX_H
#define RADIXKV_AMX_H

#include "bf16.h"

#if defined(HAVE_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Linux hands out AMX state only on request (arch_prctl); whether this process may use it.
 * Defined in paged_decode.c. */
int radixkv_enable_amx(void);
#endif

#endif
