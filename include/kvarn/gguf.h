/*
 * gguf.h -- read a GGUF model file: metadata, tensor infos, tensor data,
 * and dequantization of the supported tensor types to fp32.
 *
 * Source: the GGUF file format description (ggml docs/gguf.md), version 3
 * (version 2 has the same layout and is accepted too). All numbers in the
 * file are little-endian. Layout:
 *   header   magic "GGUF" (4 bytes), version u32, tensor_count u64,
 *            metadata_kv_count u64
 *   metadata metadata_kv_count x { key string, value_type u32, value }
 *   tensors  tensor_count x { name string, n_dims u32, ne[n_dims] u64,
 *            type u32, offset u64 }
 *   padding  to a multiple of the alignment (general.alignment, default 32)
 *   data     tensor data; each tensor at data start + its offset, which is
 *            a multiple of the alignment. Packed, as ggml requires: in
 *            offset order the first tensor at offset 0 and each next one
 *            where the previous one ends rounded up to the alignment; after
 *            the last one at most that padding (gguf-py writes it).
 * A GGUF string is a u64 byte length and that many bytes (UTF-8, not
 * NUL-terminated). An array is an element type u32, a count u64 and the
 * elements.
 *
 * The file is memory-mapped read-only and never copied; the handle owns the
 * mapping. Everything a reader returns (string views, tensor data pointers)
 * points into it and stays valid until kvarn_gguf_close().
 *
 * Opening validates the whole header up front, so that later accessors can
 * trust it: every length and offset is inside the file, element counts do
 * not overflow, no key or tensor name appears twice, every tensor's type is
 * one of the supported types below and its data lies inside the file, and
 * the data section is packed (above): no byte shared by two tensors (an
 * overlap: a type, shape or offset that does not match the data, e.g. a
 * tensor retyped in the header to a larger type) and no byte unaccounted
 * for between or after them beyond the alignment padding (a gap: e.g. a
 * tensor retyped to a smaller type). Tensor infos may be listed in any
 * order; the layout is checked in offset order. Any
 * violation is KVARN_ERR_BAD_FILE (malformed, truncated, hostile) or
 * KVARN_ERR_UNSUPPORTED (well-formed but outside what this reader serves:
 * another version, another tensor type, nested arrays), with a one-line
 * message naming the problem and its byte offset written to err. A key or
 * tensor name from the file appears in it between single quotes with any
 * byte outside printable ASCII escaped (\n, \r, \t, \xNN; ' and \ as \'
 * and \\), its first 64 bytes and "..." when longer, so that the message
 * stays one line of printable ASCII whatever the file holds. Nothing is
 * printed, nothing aborts; a handle is either fully valid or not returned.
 *
 * A handle is immutable after open: any number of threads may read it at
 * the same time.
 */
#ifndef KVARN_GGUF_H
#define KVARN_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "kvarn/alloc.h"
#include "kvarn/kvarn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Types                                                                    */
/* ------------------------------------------------------------------------ */

/* Metadata value types, numbered as in the file (gguf_metadata_value_type). */
typedef enum kvarn_gguf_type {
    KVARN_GGUF_UINT8 = 0,
    KVARN_GGUF_INT8 = 1,
    KVARN_GGUF_UINT16 = 2,
    KVARN_GGUF_INT16 = 3,
    KVARN_GGUF_UINT32 = 4,
    KVARN_GGUF_INT32 = 5,
    KVARN_GGUF_FLOAT32 = 6,
    KVARN_GGUF_BOOL = 7,      /* one byte, 0 or 1 (other values rejected) */
    KVARN_GGUF_STRING = 8,
    KVARN_GGUF_ARRAY = 9,     /* elements of one non-array type */
    KVARN_GGUF_UINT64 = 10,
    KVARN_GGUF_INT64 = 11,
    KVARN_GGUF_FLOAT64 = 12,
    KVARN_GGUF_TYPE_COUNT
} kvarn_gguf_type;

/* Tensor types this reader serves, numbered as in the file (ggml_type).
 * Any other type in a file makes kvarn_gguf_open fail with
 * KVARN_ERR_UNSUPPORTED. Blocks (ggml-quants layout):
 *   F32   4 bytes per element.
 *   F16   IEEE half, 2 bytes per element.
 *   BF16  bfloat16, 2 bytes per element.
 *   Q8_0  32 elements in 34 bytes: fp16 scale d, 32 x int8 q; x = q * d.
 *   Q4_0  32 elements in 18 bytes: fp16 d, 16 bytes of nibbles; byte j
 *         holds element j in its low nibble and element j + 16 in its high
 *         nibble; x = (q - 8) * d.
 *   Q4_1  32 elements in 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles
 *         (as Q4_0); x = q * d + m. */
typedef enum kvarn_ggml_type {
    KVARN_GGML_F32 = 0,
    KVARN_GGML_F16 = 1,
    KVARN_GGML_Q4_0 = 2,
    KVARN_GGML_Q4_1 = 3,
    KVARN_GGML_Q8_0 = 8,
    KVARN_GGML_BF16 = 30
} kvarn_ggml_type;

/* A view of a GGUF string inside the mapping: len bytes at ptr, NOT
 * NUL-terminated (use kvarn_gguf_str_copy / kvarn_gguf_str_eq). May
 * contain any bytes, including NUL. ptr is never NULL (an empty string
 * points at the mapping too). */
typedef struct kvarn_gguf_str {
    const char *ptr;
    uint64_t len;   /* bytes */
} kvarn_gguf_str;

/* Maximum tensor name length in bytes (GGUF: "at most 64 bytes"). */
#define KVARN_GGUF_MAX_NAME 64
/* Maximum tensor rank. */
#define KVARN_GGUF_MAX_DIMS 4

/* One tensor, as described by its tensor info. Plain value owned by the
 * handle; never modify it. */
typedef struct kvarn_gguf_tensor {
    char name[KVARN_GGUF_MAX_NAME + 1]; /* NUL-terminated copy */
    uint32_t n_dims;          /* 1..4 */
    uint64_t ne[KVARN_GGUF_MAX_DIMS]; /* elements per dimension, ne[0] the
                                 innermost (contiguous, a "row"); entries
                                 past n_dims are 1. A llama weight matrix
                                 of out x in is ne = {in, out}. */
    kvarn_ggml_type type;
    uint64_t offset;          /* bytes from the start of the data section */
    uint64_t n_elements;      /* ne[0] * ne[1] * ne[2] * ne[3] */
    uint64_t n_bytes;         /* bytes of data: n_elements / block size *
                                 block bytes */
    const void *data;         /* n_bytes at data section + offset, inside
                                 the mapping; aligned to the file alignment
                                 relative to the file start (so, for a
                                 mapped file, in memory too) */
} kvarn_gguf_tensor;

/* An opened file. Opaque. */
typedef struct kvarn_gguf kvarn_gguf;

/* ------------------------------------------------------------------------ */
/* Opening and closing                                                      */
/* ------------------------------------------------------------------------ */

/* Open the GGUF file at path: mmap it read-only and validate the header,
 * all metadata and all tensor infos (see the top of this file).
 *   out   receives the handle on success; set to NULL on any error.
 *   err   if not NULL, receives a NUL-terminated one-line message of at
 *         most errlen bytes on any error (e.g. "tensor 'blk.0.attn_q.weight':
 *         type 12 (Q4_K) is not supported (supported: F32, F16, BF16, Q8_0,
 *         Q4_0, Q4_1)"); left as an empty string on success.
 * Errors: KVARN_ERR_INVALID_ARG (NULL path or out), KVARN_ERR_IO (cannot
 * open, stat or map the file), KVARN_ERR_BAD_FILE (bad magic, truncated,
 * any length / count / offset past the end or overflowing, bad alignment,
 * n_dims of 0 or > 4, a zero or overflowing dimension, a row length that is
 * not a multiple of the block size, a tensor name longer than 64 bytes,
 * duplicate keys or tensor names, two tensors whose data ranges overlap:
 * "tensors 'A' (data bytes [a0, a1)) and 'B' ([b0, b1)) overlap: ...", or
 * leave bytes between them: "... leave N bytes unaccounted for: ...", a
 * first tensor not at offset 0, more than the alignment padding after the
 * last one),
 * KVARN_ERR_UNSUPPORTED (version other than 2 or 3, a tensor type not in
 * kvarn_ggml_type, nested arrays), KVARN_ERR_NOMEM. */
kvarn_status kvarn_gguf_open(const char *path, kvarn_gguf **out,
                             char *err, size_t errlen);

/* The same on size bytes already in memory (tests, fuzzing, embedded
 * models). The bytes are not copied: they must stay valid and unchanged
 * until kvarn_gguf_close(). Tensor data pointers are data + (file offset),
 * so they are only as aligned as data is. Errors as kvarn_gguf_open except
 * KVARN_ERR_IO; size 0 is KVARN_ERR_BAD_FILE, NULL data with size > 0
 * KVARN_ERR_INVALID_ARG. */
kvarn_status kvarn_gguf_open_memory(const void *data, size_t size,
                                    kvarn_gguf **out, char *err, size_t errlen);

/* kvarn_gguf_open / kvarn_gguf_open_memory with the handle and its index
 * (metadata and tensor tables) allocated through allocator (copied; must
 * outlive the handle; NULL = malloc/free, alloc.h). The file's mapping is
 * mmap's. Errors as those, and KVARN_ERR_INVALID_ARG for an allocator with
 * only one of alloc/free set. */
kvarn_status kvarn_gguf_open_ex(const char *path, const kvarn_allocator *allocator,
                                kvarn_gguf **out, char *err, size_t errlen);
kvarn_status kvarn_gguf_open_memory_ex(const void *data, size_t size,
                                       const kvarn_allocator *allocator,
                                       kvarn_gguf **out, char *err, size_t errlen);

/* Unmap and free. NULL is allowed. Every pointer and view obtained from g
 * becomes invalid. */
void kvarn_gguf_close(kvarn_gguf *g);

/* File format version (2 or 3). */
uint32_t kvarn_gguf_version(const kvarn_gguf *g);
/* Alignment of tensor data in bytes (general.alignment or 32). */
uint32_t kvarn_gguf_alignment(const kvarn_gguf *g);
/* Byte offset of the data section from the start of the file. */
uint64_t kvarn_gguf_data_offset(const kvarn_gguf *g);
/* Size of the file (or memory buffer) in bytes. */
uint64_t kvarn_gguf_file_size(const kvarn_gguf *g);

/* ------------------------------------------------------------------------ */
/* Metadata                                                                 */
/* ------------------------------------------------------------------------ */

/* Number of metadata key/value pairs, and enumeration in file order
 * (0 <= i < count). kv_key gives an empty view and kv_type
 * KVARN_GGUF_TYPE_COUNT for i out of range. */
uint64_t kvarn_gguf_kv_count(const kvarn_gguf *g);
kvarn_gguf_str kvarn_gguf_kv_key(const kvarn_gguf *g, uint64_t i);
kvarn_gguf_type kvarn_gguf_kv_type(const kvarn_gguf *g, uint64_t i);

/* Index (file order) of the pair with this key (NUL-terminated, compared
 * byte for byte), or -1 if absent. O(log n). Use it to test for optional
 * keys before calling a getter. */
int64_t kvarn_gguf_find_key(const kvarn_gguf *g, const char *key);

/* Typed getters of scalar values. On success *out is written and KVARN_OK
 * returned; on any error *out is untouched.
 *   Integer getters (u32, i32, u64, i64) accept a value of any integer
 *   type (UINT8..INT64) whose value fits the requested type exactly;
 *   e.g. a UINT64 of 30 reads as u32, an INT32 of -1 does not.
 *   f32 accepts FLOAT32, FLOAT64 (rounded to nearest) and any integer type
 *   (converted, rounded to nearest).
 *   bool accepts only BOOL; string only STRING.
 * Errors: KVARN_ERR_INVALID_ARG (NULL g, key or out), KVARN_ERR_BAD_FILE
 * (key absent, value of another type, or out of the requested range). */
kvarn_status kvarn_gguf_get_u32(const kvarn_gguf *g, const char *key, uint32_t *out);
kvarn_status kvarn_gguf_get_i32(const kvarn_gguf *g, const char *key, int32_t *out);
kvarn_status kvarn_gguf_get_u64(const kvarn_gguf *g, const char *key, uint64_t *out);
kvarn_status kvarn_gguf_get_i64(const kvarn_gguf *g, const char *key, int64_t *out);
kvarn_status kvarn_gguf_get_f32(const kvarn_gguf *g, const char *key, float *out);
kvarn_status kvarn_gguf_get_bool(const kvarn_gguf *g, const char *key, int *out);
kvarn_status kvarn_gguf_get_string(const kvarn_gguf *g, const char *key,
                                   kvarn_gguf_str *out);

/* An array value. */
typedef struct kvarn_gguf_array {
    kvarn_gguf_type type;     /* element type; never KVARN_GGUF_ARRAY */
    uint64_t n;               /* elements */
    const void *data;         /* numeric and BOOL elements: n packed
                                 little-endian values of the element type's
                                 size, possibly unaligned (read with
                                 memcpy); NULL for STRING arrays (use
                                 kvarn_gguf_array_string) */
} kvarn_gguf_array;

/* Describe the array stored under key.
 * Errors: KVARN_ERR_INVALID_ARG, KVARN_ERR_BAD_FILE (absent or not an
 * array). */
kvarn_status kvarn_gguf_get_array(const kvarn_gguf *g, const char *key,
                                  kvarn_gguf_array *out);

/* Element i (0-based) of the array under key. O(1) for every element type
 * (string arrays are indexed at open).
 *   array_string: STRING arrays only.
 *   array_i64:    any integer element type; a UINT64 above INT64_MAX fails.
 *   array_f32:    FLOAT32, FLOAT64 or any integer element type (rounded).
 * Errors: KVARN_ERR_INVALID_ARG (NULL, i >= n), KVARN_ERR_BAD_FILE (absent,
 * not an array, element type not accepted, out of range); *out untouched. */
kvarn_status kvarn_gguf_array_string(const kvarn_gguf *g, const char *key,
                                     uint64_t i, kvarn_gguf_str *out);
kvarn_status kvarn_gguf_array_i64(const kvarn_gguf *g, const char *key,
                                  uint64_t i, int64_t *out);
kvarn_status kvarn_gguf_array_f32(const kvarn_gguf *g, const char *key,
                                  uint64_t i, float *out);

/* Copy a string view into buf (len bytes) with a terminating NUL.
 * Errors: KVARN_ERR_INVALID_ARG (NULL buf or len 0),
 * KVARN_ERR_BUFFER_TOO_SMALL (s.len + 1 > len; buf then holds "" ). */
kvarn_status kvarn_gguf_str_copy(kvarn_gguf_str s, char *buf, size_t len);

/* 1 if the view holds exactly the bytes of the NUL-terminated c, else 0. */
int kvarn_gguf_str_eq(kvarn_gguf_str s, const char *c);

/* Name of a metadata value type ("uint32", "string", "array", ...);
 * "invalid" for anything else. Static string. */
const char *kvarn_gguf_type_name(kvarn_gguf_type t);

/* ------------------------------------------------------------------------ */
/* Tensors                                                                  */
/* ------------------------------------------------------------------------ */

/* Number of tensors, and tensor i in file order (NULL if out of range). */
uint64_t kvarn_gguf_tensor_count(const kvarn_gguf *g);
const kvarn_gguf_tensor *kvarn_gguf_tensor_at(const kvarn_gguf *g, uint64_t i);

/* The tensor with this exact name, or NULL if absent. O(log n). */
const kvarn_gguf_tensor *kvarn_gguf_find_tensor(const kvarn_gguf *g,
                                                const char *name);

/* Traits of a tensor type: name ("F32", "Q4_1", ... ; "unknown" if not a
 * kvarn_ggml_type), elements per block (1 for F32/F16/BF16, 32 for the Q
 * types) and bytes per block (4, 2, 2, 34, 18, 20). block_size and
 * block_bytes return 0 for an unsupported type. */
const char *kvarn_ggml_type_name(kvarn_ggml_type t);
uint32_t kvarn_ggml_block_size(kvarn_ggml_type t);
uint32_t kvarn_ggml_block_bytes(kvarn_ggml_type t);

/* Bytes of n elements of type t (n a multiple of the block size); 0 if t is
 * unsupported or n is not a multiple of the block size. */
uint64_t kvarn_ggml_row_bytes(kvarn_ggml_type t, uint64_t n);

/* Dequantize n elements of type t from src (kvarn_ggml_row_bytes(t, n)
 * bytes, any alignment) to fp32 dst[n]. This is the scalar reference the
 * model's matmuls and the tests check against.
 * Errors: KVARN_ERR_INVALID_ARG (NULL src or dst with n > 0, or n not a
 * multiple of the block size), KVARN_ERR_UNSUPPORTED (t not a
 * kvarn_ggml_type). Nothing is written on error. */
kvarn_status kvarn_ggml_dequantize(kvarn_ggml_type t, const void *src,
                                   float *dst, uint64_t n);

/* Dequantize elements [first, first + n) of tensor t (flat index, ne[0]
 * fastest) to fp32 dst[n]. first and n must be multiples of the block
 * size (any whole row qualifies: rows of a Q tensor are whole blocks, which
 * open checks); e.g. row r of a 2-D tensor is first = r * ne[0],
 * n = ne[0].
 * Errors: KVARN_ERR_INVALID_ARG (NULL, range past n_elements or not
 * block-aligned); nothing written on error. */
kvarn_status kvarn_gguf_tensor_dequantize(const kvarn_gguf_tensor *t,
                                          uint64_t first, uint64_t n,
                                          float *dst);

#ifdef __cplusplus
}
#endif

#endif /* KVARN_GGUF_H */
