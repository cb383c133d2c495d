"""test_extract_austen.py -- scripts/extract_austen.py on synthetic .rdb files
written here (R serialization version 3, XDR, one STRSXP per record): the
encoding flags, NA strings, output layout, and a clear failure on anything
unexpected. Needs no network and no R."""
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "extract_austen.py"

UTF8, LATIN1, ASCII = 1 << 3, 1 << 2, 1 << 6


def charsxp(data, enc_bits):
    if data is None:
        return struct.pack(">ii", 9, -1)
    return struct.pack(">ii", 9 | (enc_bits << 12), len(data)) + data


def serialize(elems, version=3, top_flags=16, native=b"UTF-8"):
    out = b"X\n" + struct.pack(">iii", version, 0x40201, 0x30500)
    out += struct.pack(">i", len(native)) + native
    out += struct.pack(">ii", top_flags, len(elems))
    for data, bits in elems:
        out += charsxp(data, bits)
    return out


def record(payload):
    return struct.pack(">I", len(payload)) + zlib.compress(payload)


TITLES = ["EMMA", "MANSFIELD PARK", "NORTHANGER ABBEY", "Persuasion",
          "PRIDE AND PREJUDICE", "SENSE AND SENSIBILITY"]
NAMES = ["emma", "mansfieldpark", "northangerabbey", "persuasion",
         "prideprejudice", "sensesensibility"]


def six_records(first_extra=()):
    recs = []
    for i, t in enumerate(TITLES):
        elems = [(b"", 0), (t.encode(), ASCII), (b"", 0), (f"line {i}".encode(), ASCII)]
        if i == 0:
            elems += list(first_extra)
        recs.append(record(serialize(elems)))
    return recs


def run(tmp_path, blob):
    rdb = tmp_path / "Rdata.rdb"
    rdb.write_bytes(blob)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(SCRIPT), str(rdb), str(out)],
                       capture_output=True, text=True)
    return r, out


def test_encodings_and_layout(tmp_path):
    extra = [("Émile".encode("utf-8"), UTF8), ("café".encode("latin-1"), LATIN1),
             (None, 0), ("naïve".encode("utf-8"), 0)]  # unflagged: native UTF-8
    r, out = run(tmp_path, b"".join(six_records(extra)))
    assert r.returncode == 0, r.stderr
    assert "1 NA lines" in r.stderr
    emma = (out / "emma.txt").read_text(encoding="utf-8")
    assert emma == "\nEMMA\n\nline 0\nÉmile\ncafé\n\nnaïve"
    for i, n in enumerate(NAMES):
        assert (out / f"{n}.txt").exists()
    all_txt = (out / "all.txt").read_text(encoding="utf-8")
    assert all_txt == "\n".join((out / f"{n}.txt").read_text(encoding="utf-8") for n in NAMES)


@pytest.mark.parametrize("case,msg", [
    ("five", "5 records"),
    ("truncated", "zlib stream is truncated"),
    ("bzip", "not a zlib stream"),
    ("version2", "serialization version 2"),
    ("notstr", "expected a character vector"),
    ("attr", "attribute"),
    ("bytes", "raw bytes"),
    ("badutf8", "not valid utf-8"),
    ("title", "not one of the six"),
    ("trailing", "unexpected bytes"),
    ("hugelen", "exceeds the data"),
])
def test_failures(tmp_path, case, msg):
    recs = six_records()
    if case == "five":
        recs = recs[:5]
    elif case == "truncated":
        recs[5] = recs[5][:-10]
    elif case == "bzip":
        recs[2] = recs[2][:4] + b"BZh9" + recs[2][8:]
    elif case == "version2":
        recs[1] = record(serialize([(b"EMMA", ASCII)], version=2))
    elif case == "notstr":
        recs[1] = record(serialize([(b"EMMA", ASCII)], top_flags=13))
    elif case == "attr":
        recs[1] = record(serialize([(b"EMMA", ASCII)], top_flags=16 | (1 << 9)))
    elif case == "bytes":
        recs[3] = record(serialize([(b"Persuasion", 1 << 1)]))
    elif case == "badutf8":
        recs[3] = record(serialize([(b"Persuasion", ASCII), (b"\xff\xfe", UTF8)]))
    elif case == "title":
        recs[4] = record(serialize([(b"ULYSSES", ASCII)]))
    elif case == "trailing":
        recs[4] = record(serialize([(b"PRIDE AND PREJUDICE", ASCII)]) + b"\0\0")
    elif case == "hugelen":
        p = bytearray(serialize([(b"EMMA", ASCII)]))
        p[-16:-12] = struct.pack(">i", 0x7fffffff)  # the vector length field
        recs[0] = record(bytes(p))
    r, out = run(tmp_path, b"".join(recs))
    assert r.returncode == 1
    assert msg in r.stderr, r.stderr
    assert not (out / "all.txt").exists()
