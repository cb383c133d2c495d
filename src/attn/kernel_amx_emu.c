/*
 * kernel_amx_emu.c -- the AMX matrix kernel of kernel_amx.c with its tile
 * operations emulated in C (amx_tiles.h) and the scalar softmax step:
 * attn_amxemu_kvarn_tile, the same logic and the same rounding statement
 * on any CPU. Run only where a test asks for it (kvarn_attn_testing.amx =
 * 2, attn.h); compiled with the baseline flags.
 */
#define KVARN_AMX_EMULATE 1
#include "attn/kernel_amx.c"
