"""Hostile KServe v2 infer requests: a valid request for a model, then mutated.

Pure and seeded: `fuzz_case(rng, models)` turns a `random.Random` into one `FuzzCase`
from the models' metadata (`GET /v2/models/{m}`) and a few mutations of the JSON, shapes,
datatypes, names, data, the binary extension, the encoding, headers, methods and paths;
`wire_bytes` adds HTTP-level lies. `tests/integration/test_fuzz_http.py` draws the
`Random` from hypothesis; the chaos benchmark draws 100,000 from a seed. A server must
answer every case, never with a 5xx, and every error as JSON `{"error": "..."}`.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import json
import math
import random
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server import codec

_NP = {"BOOL": np.bool_, "UINT8": np.uint8, "INT8": np.int8, "INT16": np.int16,
       "INT32": np.int32, "INT64": np.int64, "FP16": np.float16, "FP32": np.float32,
       "FP64": np.float64}
DATATYPES = [*_NP, "BYTES", "UINT16", "UINT32", "UINT64", "BF16", "fp32", "", "FP32 "]
JUNK: list[Any] = [None, True, False, 0, -1, 1.5, 2**64, -(2**63) - 1, 1e308, "", "x",
                   "\u0000", "\ud7ff\u00e9", [], [None], {}, {"a": {"b": [1, {}]}}, [[[]]],
                   "9" * 400, [1] * 50]
HUGE_SHAPES = [[10**9, 3, 224, 224], [2**31, 3], [2**63, 2**63], [1, 10**12], [10**18],
               [-1, 3], [0, 3], [1, -3], [1.0, 3], [True, 3], ["1", "3"], [], [[1], 3],
               [1] * 70, None, "1,3", {"0": 1}]
ENCODINGS = ["gzip", "deflate", "GZIP", "x-gzip", "identity", "br", "gzip, gzip", "*", ""]
CONTENT_TYPES = ["application/json", "application/octet-stream", "text/plain",
                 "application/json; charset=utf-16", "multipart/form-data; boundary=x",
                 "application/x-www-form-urlencoded", "", "\x7f", "application/" + "j" * 300]


@dataclass
class FuzzCase:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    chunked: bool = False  # send the body chunked (no Content-Length)
    mutations: list[str] = field(default_factory=list)  # what was done, for the report

    def raw_headers(self) -> dict[str, bytes]:  # UTF-8: some are not ASCII on purpose
        return {k: v.encode() for k, v in self.headers.items()}

    def chunks(self, rng: random.Random) -> list[bytes]:
        cuts = sorted(rng.randrange(len(self.body) + 1) for _ in range(rng.randrange(4)))
        bounds = [0, *cuts, len(self.body)]
        return [self.body[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def valid_header(rng: random.Random, meta: dict[str, Any], *, binary: bool
                 ) -> tuple[dict[str, Any], list[bytes]]:
    """A valid request header for `meta` and, when `binary`, the tensors after it."""
    n = rng.randint(1, max(1, min(meta.get("max_batch_size", 1), 4)))
    inputs, blobs = [], []
    for t in meta["inputs"]:
        shape = [n, *(d if d != -1 else rng.randint(1, 3) for d in t["shape"][1:])]
        dt = _NP[t["datatype"]]
        count = math.prod(shape)
        if t["datatype"] == "BOOL":
            x = np.array([rng.random() < 0.5 for _ in range(count)], dt)
        elif np.issubdtype(dt, np.integer):
            info = np.iinfo(dt)
            x = np.array([rng.randint(max(info.min, -100), min(info.max, 100))
                          for _ in range(count)], dt)
        else:
            x = np.array([rng.uniform(-3, 3) for _ in range(count)] if count < 64
                         else np.random.default_rng(rng.randrange(2**32)).random(count), dt)
        entry: dict[str, Any] = {"name": t["name"], "datatype": t["datatype"], "shape": shape}
        if binary:
            raw = x.astype(x.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        elif rng.random() < 0.2 and len(shape) > 1:
            entry["data"] = x.reshape(shape).tolist()  # nested lists of exactly the shape
        else:
            entry["data"] = x.tolist()
        inputs.append(entry)
    head: dict[str, Any] = {"inputs": inputs}
    if rng.random() < 0.3:
        head["id"] = rng.choice(["1", "req-" + str(rng.randrange(10**6)), "", "\u00e9"])
    r = rng.random()
    if r < 0.3:
        head["outputs"] = [{"name": o["name"], "parameters": {"binary_data": rng.random() < 0.5}}
                           for o in meta["outputs"] if rng.random() < 0.7]
    elif r < 0.5:
        head["parameters"] = {"binary_data_output": rng.random() < 0.5}
    return head, blobs


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value in `obj` (keys, indices); long lists cut, deep ones not followed."""
    out = [prefix]
    if len(prefix) > 12:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            out += _paths(v, (*prefix, i))
    return out


def _tensor(head: dict[str, Any], rng: random.Random, key: str = "inputs") -> dict | None:
    ts = head.get(key)
    if isinstance(ts, list) and ts and isinstance(ts[0], dict):
        return rng.choice([t for t in ts if isinstance(t, dict)] or [None])
    return None


def _junk(rng: random.Random, pool: list[Any] = JUNK) -> Any:
    return copy.deepcopy(rng.choice(pool))  # a copy: later mutations change it in place


def m_replace(rng: random.Random, head: dict, blobs: list) -> str:
    path = rng.choice(_paths(head)[1:] or [("inputs",)])
    _value(head, path[:-1])[path[-1]] = (_junk(rng) if rng.random() < 0.8
                                         else _deep(rng.randint(50, 900)))
    return f"replace {path}"


def m_delete(rng: random.Random, head: dict, blobs: list) -> str:
    path = rng.choice(_paths(head)[1:] or [("inputs",)])
    with contextlib.suppress(KeyError, IndexError):
        del _value(head, path[:-1])[path[-1]]
    return f"delete {path}"


def m_add_key(rng: random.Random, head: dict, blobs: list) -> str:
    path = rng.choice([p for p in _paths(head) if isinstance(_value(head, p), dict)])
    key = rng.choice(["extra", "parameters", "data", "shape", "datatype", "name", "outputs",
                      "binary_data_size", "binary_data", "binary_data_output", "id",
                      "classification", "shared_memory_region", "shared_memory_byte_size"])
    _value(head, path)[key] = _junk(rng)
    return f"add {key} at {path}"


def _value(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def _deep(depth: int) -> Any:
    x: Any = 1
    for _ in range(depth):
        x = [x]
    return x


def m_shape(rng: random.Random, head: dict, blobs: list) -> str:
    t = _tensor(head, rng)
    if t is None:
        return "shape: no tensor"
    if rng.random() < 0.5 or not isinstance(t.get("shape"), list) or not t["shape"]:
        t["shape"] = _junk(rng, HUGE_SHAPES)
    else:
        s = list(t["shape"])
        i = rng.randrange(len(s))
        s[i] = rng.choice([0, -1, -2, 2, 5, 10**9, 2**40, 2**64, s[i] + 1])
        if rng.random() < 0.3:
            s.append(rng.choice([1, 3]))
        t["shape"] = s
    return f"shape {t.get('shape')!r:.60}"


def m_datatype(rng: random.Random, head: dict, blobs: list) -> str:
    t = _tensor(head, rng)
    if t is None:
        return "datatype: no tensor"
    t["datatype"] = rng.choice(DATATYPES)
    return f"datatype {t['datatype']!r}"


def m_name(rng: random.Random, head: dict, blobs: list) -> str:
    ins = head.get("inputs")
    if not isinstance(ins, list) or not ins or not isinstance(ins[0], dict):
        return "name: no tensor"
    r = rng.random()
    if r < 0.35:
        rng.choice(ins)["name"] = rng.choice(["", "X", "input ", "y", "\u00e9", "a" * 1000])
        return "rename input"
    if r < 0.7:
        ins.append(json.loads(json.dumps(rng.choice(ins))))
        return "duplicate input"
    extra = json.loads(json.dumps(rng.choice(ins)))
    extra["name"] = "extra_" + str(rng.randrange(100))
    ins.append(extra)
    return "extra input"


def m_data(rng: random.Random, head: dict, blobs: list) -> str:
    t = _tensor(head, rng)
    if t is None:
        return "data: no tensor"
    data = t.get("data")
    flat = data if isinstance(data, list) else [1]
    choices = [
        lambda: flat[:-1], lambda: [*flat, flat[0] if flat else 0], lambda: [],
        lambda: ["1"] * len(flat), lambda: [[v] for v in flat], lambda: [flat, flat[:1]],
        lambda: [2**70] * len(flat), lambda: [-(2**63)] * len(flat), lambda: [300] * len(flat),
        lambda: [-129] * len(flat), lambda: [True] * len(flat), lambda: [1.5] * len(flat),
        lambda: [None] * len(flat), lambda: [{}] * len(flat), lambda: _deep(100),
        lambda: "1,2,3", lambda: {"0": 1}, lambda: [1e38] * len(flat),
        lambda: [-1e-45] * len(flat), lambda: [[[v]] for v in flat],
    ]
    t["data"] = rng.choice(choices)()
    if rng.random() < 0.3:  # a JSON tensor that also claims binary data
        t.setdefault("parameters", {})["binary_data_size"] = rng.choice([0, 12, -1, 2**40])
    return "data"


def m_params(rng: random.Random, head: dict, blobs: list) -> str:
    target = rng.choice([head, _tensor(head, rng), _tensor(head, rng, "outputs")])
    if target is None:
        target = head
    key = rng.choice(["binary_data_size", "binary_data", "binary_data_output",
                      "classification", "shared_memory_region", "shared_memory_offset"])
    p = target.get("parameters")
    if not isinstance(p, dict):
        p = target["parameters"] = {}
    p[key] = _junk(rng, [*JUNK, 0, 1, 4, 11, 13, 2**40, -4, "true", 1.0])
    return f"parameters {key}={p[key]!r:.40}"


def m_outputs(rng: random.Random, head: dict, blobs: list) -> str:
    head["outputs"] = rng.choice([
        [{"name": "nope"}], [{}], [{"name": 1}], "y", {"name": "y"}, [None], [],
        [{"name": "y", "parameters": {"binary_data": "yes"}}],
        [{"name": "y", "parameters": {"classification": 3}}],
        [{"name": "y"}, {"name": "y"}], [{"name": "y", "parameters": []}],
    ])
    return "outputs"


def m_binary_size(rng: random.Random, head: dict, blobs: list) -> str:
    t = _tensor(head, rng)
    if t is None or not blobs:
        return m_data(rng, head, blobs)
    p = t.setdefault("parameters", {}) if isinstance(t.get("parameters", {}), dict) else {}
    size = p.get("binary_data_size", 0)
    size = size if type(size) is int else 0
    p["binary_data_size"] = rng.choice([size - 1, size + 1, 0, -size, size * 2, 2**62,
                                        float(size), str(size), None, True])
    return f"binary_data_size {p['binary_data_size']!r}"


STRUCTURAL = [m_replace, m_delete, m_add_key, m_shape, m_datatype, m_name, m_data, m_params,
              m_outputs, m_binary_size]


def _dump(rng: random.Random, head: dict) -> bytes:
    try:
        text = json.dumps(head, allow_nan=True, ensure_ascii=rng.random() < 0.5)
    except (ValueError, RecursionError):
        text = json.dumps({"inputs": "deep"})
    return text.encode("utf-8", "surrogatepass")


def encoding_mutation(rng: random.Random, header: bytes) -> tuple[bytes, str]:
    """Mutate the JSON header's bytes (the binary tensors after it are left alone)."""
    r = rng.randrange(12)
    if r == 0 and len(header) > 1:
        cut = rng.randrange(1, len(header))
        return header[:cut], f"truncated at {cut}"
    if r == 1:
        b = bytearray(header)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b), "flipped bytes"
    if r == 2:
        return header + rng.choice([b"x", b"}", b" {}", b"\x00", b"\xff\xfe"]), "trailing junk"
    if r == 3:
        i = rng.randrange(len(header) + 1)
        return header[:i] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf"]) \
            + header[i:], "non-UTF-8"
    if r == 4:
        return b"\xef\xbb\xbf" + header, "BOM"
    if r == 5:
        return header.decode("utf-8", "replace").encode("utf-16"), "UTF-16"
    if r == 6:  # duplicate keys: a second "inputs" (or other) with junk, or the same again
        key = rng.choice([b'"inputs"', b'"shape"', b'"datatype"', b'"data"', b'"name"'])
        i = header.find(key)
        if i >= 0:
            dup = key + b": " + rng.choice([b"null", b"[]", b"1", b'"x"', b"{}"]) + b", "
            return header[:i] + dup + header[i:], f"duplicate key {key.decode()}"
        return header, "duplicate key: none"
    if r == 7:
        token = rng.choice([b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"0x10",
                            b"01", b"1.", b".5", b"+1", b"1e", b"tru", b"nul", b'"\\ud800"'])
        i = header.find(b'"data": [')
        if i >= 0:
            i += len(b'"data": [')
            return header[:i] + token + b", " + header[i:], f"token {token.decode()}"
        return header.replace(b"[", b"[" + token + b", ", 1), f"token {token.decode()}"
    if r == 8:
        return b"[" * rng.randint(500, 5000) + b"]" * rng.randint(0, 5000), "deep brackets"
    if r == 9:
        return rng.choice([b"", b"null", b"[]", b"1", b'"inputs"', b"{}", b"{", b" "]), "tiny"
    if r == 10:
        return header.replace(b'"', b"'"), "single quotes"
    return header + b" " * rng.randint(1, 1000), "trailing whitespace"


def fuzz_case(rng: random.Random, models: dict[str, dict[str, Any]], *,
              max_body_bytes: int = 1 << 20, over_limit_rate: float = 0.02) -> FuzzCase:
    """One hostile request for one of `models` (name -> metadata); about one in eight is
    left valid (answered 200), one in twenty sent chunked, `over_limit_rate` of them just
    over `max_body_bytes`."""
    name = rng.choice(sorted(models))
    meta = models[name]
    binary = rng.random() < 0.45
    head, blobs = valid_header(rng, meta, binary=binary)
    done: list[str] = []
    n_mut = rng.choice([0, 1, 1, 1, 2, 2, 3, 5])
    for _ in range(n_mut):
        try:
            done.append(rng.choice(STRUCTURAL)(rng, head, blobs))
        except (TypeError, AttributeError, KeyError, IndexError, ValueError, RecursionError):
            done.append("structural: skipped")  # an earlier mutation left nothing to mutate
    header = _dump(rng, head)
    if rng.random() < 0.25:
        header, what = encoding_mutation(rng, header)
        done.append(what)
    data = b"".join(blobs)
    if binary and rng.random() < 0.15:  # the binary part cut short or grown
        data = data[: rng.randrange(len(data) + 1)] if rng.random() < 0.6 else data + b"\0" * 7
        done.append("binary part resized")
    body = header + data
    headers: dict[str, str] = {}
    if binary:
        headers["Content-Type"] = "application/octet-stream"
        hlen: Any = len(header)
        if rng.random() < 0.2:
            hlen = rng.choice([None, -1, 0, len(header) - 1, len(header) + 1, len(body),
                               len(body) + 1, 2**64, "abc", "", " 12", "0x10", "1e3", "١٢",
                               str(len(header)) + ".0", "+" + str(len(header))])
            done.append(f"header length {hlen!r}")
        if hlen is not None:
            headers[codec.HEADER_LENGTH] = str(hlen)
    else:
        headers["Content-Type"] = "application/json"
        if rng.random() < 0.05:
            headers[codec.HEADER_LENGTH] = str(rng.choice([0, 5, len(body), 10**9, -3]))
            done.append("header length on JSON")
    if rng.random() < 0.1:
        headers["Content-Type"] = rng.choice(CONTENT_TYPES)
        done.append(f"content type {headers['Content-Type']!r:.40}")
    if rng.random() < 0.05:  # compressed, or said to be (the server decompresses gzip, deflate)
        encoding = rng.choice(ENCODINGS)
        how = rng.choice(["compressed", "compressed", "as it is", "cut short"])
        if encoding.lower() in ("gzip", "x-gzip", "deflate") and how != "as it is":
            packed = zlib.compress(body) if encoding == "deflate" else gzip.compress(body)
            body = packed if how == "compressed" else packed[:rng.randrange(len(packed))]
        headers["Content-Encoding"] = encoding
        done.append(f"content encoding {encoding!r} ({how})")
    if rng.random() < over_limit_rate:  # bigger than the limit: 413, never more memory than that
        body += b" " * (max_body_bytes + 1 - len(body))
        done.append("over the body limit")
    path = f"/v2/models/{name}/infer"
    method = "POST"
    r = rng.random()
    if r < 0.03:
        path = rng.choice([f"/v2/models/{name}/versions/1/infer",
                           f"/v2/models/{name}/versions/2/infer", "/v2/models/nope/infer",
                           f"/v2/models/{name}%00/infer",
                           "/v2/models/" + "m" * 2000 + "/infer", f"/v2/models/{name}/infer/",
                           "/v2/models//infer", "/v2/models/%ff/infer", f"/v2/models/{name}"])
        done.append(f"path {path:.60}")
    elif r < 0.05:
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH"])
        done.append(f"method {method}")
    chunked = rng.random() < 0.05
    if chunked:
        done.append("chunked")
    return FuzzCase(method, path, headers, body, chunked, done)


def decode_json_error(body: bytes) -> str | None:
    """The "error" of a JSON error body; None when the body is not one."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(obj, dict) and isinstance(obj.get("error"), str):
        return obj["error"]
    return None


def wire_bytes(case: FuzzCase, rng: random.Random, *, host: str = "127.0.0.1",
               lie_rate: float = 0.1) -> tuple[bytes, str | None]:
    """`case` as the bytes of one HTTP/1.1 request (`Connection: close`) and, with
    probability `lie_rate`, the lie told at the HTTP level (Content-Length short, long,
    doubled, negative or junk, a bad header, broken chunked framing)."""
    lines = [f"{case.method} {case.path} HTTP/1.1".encode(), b"Host: " + host.encode(),
             b"Connection: close"]
    lines += [k.encode() + b": " + v for k, v in case.raw_headers().items()]
    body = case.body
    lie = None
    if rng.random() < lie_rate:
        lie = rng.choice(["short", "long", "twice", "negative", "junk", "non-ascii header",
                          "no colon", "bad chunk", "cl and chunked", "space in name"])
    if lie == "short":
        lines.append(b"Content-Length: %d" % max(0, len(body) - rng.randint(1, 20)))
    elif lie == "long":
        lines.append(b"Content-Length: %d" % (len(body) + rng.randint(1, 20)))
    elif lie == "twice":
        lines += [b"Content-Length: %d" % len(body), b"Content-Length: %d" % (len(body) + 1)]
    elif lie == "negative":
        lines.append(b"Content-Length: -%d" % len(body))
    elif lie == "junk":
        lines.append(b"Content-Length: " + rng.choice([b"abc", b"1e3", b"0x10", b"", b"\xff"]))
    elif lie in ("bad chunk", "cl and chunked") or case.chunked:
        lines.append(b"Transfer-Encoding: chunked")
        if lie == "cl and chunked":
            lines.append(b"Content-Length: %d" % len(body))
        chunks = case.chunks(rng)
        framed = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks if c) + b"0\r\n\r\n"
        if lie == "bad chunk":
            framed = rng.choice([b"zz\r\n", b"-1\r\n", b"5\r\nab\r\n"]) + framed
        body = framed
    else:
        lines.append(b"Content-Length: %d" % len(body))
    if lie == "non-ascii header":
        lines.append(b"X-Junk: \xff\xfe\x00\x7f")
    elif lie == "no colon":
        lines.append(b"this is not a header")
    elif lie == "space in name":
        lines.append(b"Content Type: x")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body, lie


def parse_status(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one HTTP/1.1 response read to the
    end of the connection; status 0 when there is none."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return 0, {}, raw
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    n = headers.get("content-length")
    if n is not None and n.isdigit():
        body = body[: int(n)]
    return status, headers, body
