#!/usr/bin/env python3
"""extract_austen.py -- Jane Austen's six novels from r-cran-janeaustenr's
data/Rdata.rdb into plain UTF-8 text files (../shared/EVAL.md "Text").

Usage: extract_austen.py RDATA_RDB OUTDIR

Rdata.rdb is six records back to back. Each record is a 4-byte big-endian
uncompressed length, then a zlib stream holding an R serialization
(format version 3, "X\\n" = big-endian XDR) of one character vector (STRSXP)
whose elements (CHARSXP) are the novel's lines. No R install is needed: the
small reader below understands exactly that and fails with a clear message
on anything else.

Writes OUTDIR/<novel>.txt (lines joined by "\\n", no trailing newline) for
each novel and OUTDIR/all.txt (the six in the package's order, joined by
"\\n"). A novel is named by its title line, as janeaustenr names it.
Exit status 0 on success, 1 with a message on stderr on any failure.
"""
import os
import struct
import sys
import zlib

# R's SEXP types and flag bits (R Internals, "Serialization formats").
STRSXP = 16
CHARSXP = 9
IS_OBJECT_BIT = 1 << 8
HAS_ATTR_BIT = 1 << 9
HAS_TAG_BIT = 1 << 10
# CHARSXP encoding bits live in the "levels" field (flags >> 12).
BYTES_MASK = 1 << 1
LATIN1_MASK = 1 << 2
UTF8_MASK = 1 << 3
ASCII_MASK = 1 << 6
NA_LENGTH = -1

# Title line (upper-cased) -> janeaustenr's name for the novel.
TITLES = {
    "SENSE AND SENSIBILITY": "sensesensibility",
    "PRIDE AND PREJUDICE": "prideprejudice",
    "MANSFIELD PARK": "mansfieldpark",
    "EMMA": "emma",
    "NORTHANGER ABBEY": "northangerabbey",
    "PERSUASION": "persuasion",
}


class FormatError(Exception):
    pass


class XdrReader:
    """Big-endian reader over one decompressed R serialization."""

    def __init__(self, buf, what):
        self.buf = buf
        self.pos = 0
        self.what = what

    def need(self, n):
        if n < 0 or self.pos + n > len(self.buf):
            raise FormatError(
                f"{self.what}: truncated at byte {self.pos} "
                f"(need {n} more bytes, {len(self.buf) - self.pos} left)")

    def int32(self):
        self.need(4)
        (v,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return v

    def raw(self, n):
        self.need(n)
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b


def decode_charsxp(r, native_enc, index):
    """One element of the vector: returns (str or None for NA)."""
    at = r.pos
    flags = r.int32()
    sexptype = flags & 0xFF
    if sexptype != CHARSXP:
        raise FormatError(f"{r.what}: element {index} at byte {at} has SEXP "
                          f"type {sexptype}, expected CHARSXP ({CHARSXP})")
    if flags & (IS_OBJECT_BIT | HAS_ATTR_BIT | HAS_TAG_BIT):
        raise FormatError(f"{r.what}: element {index} has unexpected "
                          f"object/attribute/tag flags 0x{flags:x}")
    levels = (flags >> 12) & 0xFFFF
    length = r.int32()
    if length == NA_LENGTH:
        return None
    if length < 0:
        raise FormatError(f"{r.what}: element {index} has negative length "
                          f"{length}")
    data = r.raw(length)
    if levels & BYTES_MASK:
        raise FormatError(f"{r.what}: element {index} is marked as raw bytes "
                          "(no text encoding)")
    if levels & UTF8_MASK:
        enc = "utf-8"
    elif levels & LATIN1_MASK:
        enc = "latin-1"
    elif levels & ASCII_MASK:
        enc = "ascii"
    else:
        enc = native_enc  # unmarked strings are in the writer's encoding
    try:
        return data.decode(enc)
    except (UnicodeDecodeError, LookupError) as e:
        raise FormatError(f"{r.what}: element {index} is not valid {enc}: {e}")


def read_character_vector(buf, what):
    """Parse an R serialization (version 3, XDR) of one STRSXP."""
    r = XdrReader(buf, what)
    magic = r.raw(2)
    if magic != b"X\n":
        raise FormatError(f"{what}: serialization format {magic!r} is not "
                          "XDR ('X\\n')")
    version = r.int32()
    if version != 3:
        raise FormatError(f"{what}: R serialization version {version}, "
                          "expected 3")
    r.int32()  # R version that wrote it
    r.int32()  # minimal R version to read it
    nelen = r.int32()
    if nelen < 0 or nelen > 64:
        raise FormatError(f"{what}: bad native encoding length {nelen}")
    native = r.raw(nelen).decode("ascii", "replace")
    native_enc = {"UTF-8": "utf-8", "latin1": "latin-1",
                  "ISO-8859-1": "latin-1"}.get(native)
    if native_enc is None:
        raise FormatError(f"{what}: unexpected native encoding {native!r}")
    at = r.pos
    flags = r.int32()
    if flags & 0xFF != STRSXP:
        raise FormatError(f"{what}: top-level object at byte {at} has SEXP "
                          f"type {flags & 0xFF}, expected a character vector "
                          f"(STRSXP, {STRSXP})")
    if flags & (IS_OBJECT_BIT | HAS_ATTR_BIT | HAS_TAG_BIT):
        raise FormatError(f"{what}: character vector has unexpected "
                          f"object/attribute/tag flags 0x{flags:x}")
    n = r.int32()
    if n == -1:  # long vector: two more ints give the 64-bit length
        n = (r.int32() << 32) | (r.int32() & 0xFFFFFFFF)
    if n < 0:
        raise FormatError(f"{what}: negative vector length {n}")
    # Each element takes at least 8 bytes: reject absurd lengths up front.
    if n * 8 > len(buf) - r.pos:
        raise FormatError(f"{what}: vector length {n} exceeds the data")
    lines = []
    n_na = 0
    for i in range(n):
        s = decode_charsxp(r, native_enc, i)
        if s is None:
            n_na += 1
            s = ""  # an NA line carries no text
        lines.append(s)
    if r.pos != len(buf):
        raise FormatError(f"{what}: {len(buf) - r.pos} unexpected bytes after "
                          "the character vector")
    return lines, n_na


def read_rdb(path):
    with open(path, "rb") as f:
        data = f.read()
    records = []
    off = 0
    while off < len(data):
        what = f"{path} record {len(records)} (byte {off})"
        if off + 5 > len(data):
            raise FormatError(f"{what}: truncated record header")
        (ulen,) = struct.unpack_from(">I", data, off)
        d = zlib.decompressobj()
        try:
            out = d.decompress(data[off + 4:], ulen + 1)
        except zlib.error as e:
            raise FormatError(f"{what}: not a zlib stream ({e}); only "
                              "zlib-compressed .rdb files are supported")
        if not d.eof:
            raise FormatError(f"{what}: zlib stream is truncated or longer "
                              f"than the recorded length {ulen}")
        if len(out) != ulen:
            raise FormatError(f"{what}: decompressed {len(out)} bytes, "
                              f"header says {ulen}")
        used = len(data) - off - 4 - len(d.unused_data)
        records.append((what, out))
        off += 4 + used
    return records


def main(argv):
    if len(argv) != 3:
        print("usage: extract_austen.py RDATA_RDB OUTDIR", file=sys.stderr)
        return 2
    rdb, outdir = argv[1], argv[2]
    try:
        records = read_rdb(rdb)
        if len(records) != 6:
            raise FormatError(f"{rdb}: {len(records)} records, expected the "
                              "six novels")
        novels = []
        for what, buf in records:
            lines, n_na = read_character_vector(buf, what)
            title = next((s.strip() for s in lines if s.strip()), "")
            name = TITLES.get(title.upper())
            if name is None:
                raise FormatError(f"{what}: first line {title!r} is not one of "
                                  "the six novels' titles")
            if any(name == m for m, _ in novels):
                raise FormatError(f"{what}: '{name}' appears twice")
            if n_na:
                print(f"extract_austen: {name}: {n_na} NA lines written as "
                      "empty lines", file=sys.stderr)
            novels.append((name, lines))
    except (OSError, FormatError) as e:
        print(f"extract_austen: {e}", file=sys.stderr)
        return 1

    os.makedirs(outdir, exist_ok=True)
    texts = []
    for name, lines in novels:
        text = "\n".join(lines)
        texts.append(text)
        write_text(os.path.join(outdir, name + ".txt"), text)
    write_text(os.path.join(outdir, "all.txt"), "\n".join(texts))
    total = sum(len(t) for t in texts)
    print(f"extract_austen: wrote {len(novels)} novels, {total} characters, "
          f"to {outdir}", file=sys.stderr)
    return 0


def write_text(path, text):
    # Write to a temporary name first so that a crash never leaves a
    # half-written file that a later run would take as complete.
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
