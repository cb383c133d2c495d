/*
 * amx_tiles.h -- the few Intel AMX tile operations the matrix kernel
 * (kernel_amx.c) uses, as the hardware's intrinsics or, with
 * KVARN_AMX_EMULATE defined, as plain C that follows the instructions'
 * definitions (Intel SDM vol. 2, LDTILECFG, TILELOADD, TILESTORED,
 * TILEZERO, TDPBF16PS, TILERELEASE), so that the kernel's logic is tested
 * on any CPU (kernel_amx_emu.c), as tests/cuda/emu does for the CUDA
 * kernels. Not part of the public contract.
 *
 * Tile numbers are compile-time constants (the instructions encode them).
 * Every tile the kernel configures is 16 rows of 64 bytes: 16 x 16 fp32
 * (C), 16 x 32 bf16 (A), or 16 pairs of rows x 16 columns of bf16 pairs
 * (B, the "VNNI" layout: element (k, n) at row k / 2, column 2 n + k % 2).
 */
#ifndef KVARN_AMX_TILES_H
#define KVARN_AMX_TILES_H

#include <stdint.h>
#include <string.h>

/* LDTILECFG's 64-byte operand (palette 1). */
typedef struct amx_tilecfg {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16]; /* bytes per row of tile i */
    uint8_t rows[16];   /* rows of tile i */
} amx_tilecfg;

/* Tiles 0..6 as 16 rows x 64 bytes. */
static inline void amx_config_16x64(amx_tilecfg *c)
{
    memset(c, 0, sizeof *c);
    c->palette = 1;
    for (int i = 0; i < 7; i++) {
        c->colsb[i] = 64;
        c->rows[i] = 16;
    }
}

#ifdef KVARN_AMX_EMULATE

/* The emulated tile file of the calling thread. */
typedef struct amx_emu_state {
    amx_tilecfg cfg;
    union {
        uint8_t b[16][64];
        float f[16][16];
        uint16_t h[16][32];
    } t[8];
} amx_emu_state;
static _Thread_local amx_emu_state amx_emu;

static inline void amx_emu_load(int n, const void *base, long stride)
{
    const uint8_t *p = base;
    for (int m = 0; m < amx_emu.cfg.rows[n]; m++)
        memcpy(amx_emu.t[n].b[m], p + (long)m * stride, amx_emu.cfg.colsb[n]);
}

static inline void amx_emu_store(int n, void *base, long stride)
{
    uint8_t *p = base;
    for (int m = 0; m < amx_emu.cfg.rows[n]; m++)
        memcpy(p + (long)m * stride, amx_emu.t[n].b[m], amx_emu.cfg.colsb[n]);
}

/* A bf16 input as TDPBF16PS reads it: denormals as zero (DAZ). */
static inline float amx_emu_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1], in fp32
 * in the order of the SDM's pseudo-code (the products of two bf16 values
 * are exact in fp32). */
static inline void amx_emu_dpbf16ps(int c, int a, int b)
{
    const int M = amx_emu.cfg.rows[c], N = amx_emu.cfg.colsb[c] / 4, K = amx_emu.cfg.colsb[a] / 4;
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++)
            for (int n = 0; n < N; n++) {
                float acc = amx_emu.t[c].f[m][n];
                acc += amx_emu_bf16(amx_emu.t[a].h[m][2 * k]) * amx_emu_bf16(amx_emu.t[b].h[k][2 * n]);
                acc += amx_emu_bf16(amx_emu.t[a].h[m][2 * k + 1]) *
                       amx_emu_bf16(amx_emu.t[b].h[k][2 * n + 1]);
                amx_emu.t[c].f[m][n] = acc;
            }
}

#define AMX_CONFIG(c) memcpy(&amx_emu.cfg, (c), sizeof amx_emu.cfg)
#define AMX_RELEASE() memset(&amx_emu, 0, sizeof amx_emu)
#define AMX_ZERO(n) memset(amx_emu.t[n].b, 0, sizeof amx_emu.t[n].b)
#define AMX_LOAD(n, base, stride) amx_emu_load((n), (base), (long)(stride))
#define AMX_STORE(n, base, stride) amx_emu_store((n), (base), (long)(stride))
#define AMX_DPBF16PS(c, a, b) amx_emu_dpbf16ps((c), (a), (b))

#else /* the hardware's instructions (compiled with -mamx-tile -mamx-bf16) */

#include <immintrin.h>

#define AMX_CONFIG(c) _tile_loadconfig(c)
#define AMX_RELEASE() _tile_release()
/* GCC's tile macros paste the tile number into the instruction's text:
 * pass the bare literal. */
#define AMX_ZERO(n) _tile_zero(n)
#define AMX_LOAD(n, base, stride) _tile_loadd(n, (base), (stride))
#define AMX_STORE(n, base, stride) _tile_stored(n, (base), (stride))
#define AMX_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)

#endif

#endif
