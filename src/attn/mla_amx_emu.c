/*
 * mla_amx_emu.c -- the MLA tile products of mla_amx.c with the tile
 * operations emulated in C (amx_tiles.h): the same logic and rounding on
 * any CPU, run where KVARN_AMX=emulate asks for it (tests, measurements);
 * compiled with the baseline flags.
 */
#define KVARN_AMX_EMULATE 1
#include "attn/mla_amx.c"
