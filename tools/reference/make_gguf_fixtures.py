#!/usr/bin/env python3
"""Writes the GGUF fixtures of tests/io/gguf_test.cpp with gguf-py, llama.cpp's own GGUF writer
(the reference implementation of the format), so the C++ reader is checked against files it did
not write. gguf-py comes with the llama.cpp source that scripts/pack-llama-peer.sh packs; numpy
from Debian (python3-numpy).
Usage: /usr/bin/python3 tools/reference/make_gguf_fixtures.py GGUF_PY_DIR tests/data/gguf"""
import os
import sys

sys.path.insert(0, sys.argv[1])
import gguf  # noqa: E402
import numpy as np  # noqa: E402

out = sys.argv[2]
os.makedirs(out, exist_ok=True)
w = gguf.GGUFWriter(os.path.join(out, "small.gguf"), "qwen35")
w.add_uint8("test.u8", 200)
w.add_int8("test.i8", -100)
w.add_uint16("test.u16", 60000)
w.add_int16("test.i16", -30000)
w.add_uint32("test.u32", 4000000000)
w.add_int32("test.i32", -2000000000)
w.add_float32("test.f32", 0.5)
w.add_uint64("test.u64", 1 << 40)
w.add_int64("test.i64", -(1 << 40))
w.add_float64("test.f64", 0.25)
w.add_bool("test.bool", True)
w.add_string("test.string", "héllo")
w.add_array("test.tokens", ["a", "b", "<|im_end|>"])
w.add_array("test.ints", [1, -2, 3])
w.add_block_count(2)
w.add_tensor("t.f32", np.arange(12, dtype=np.float32).reshape(3, 4))
w.add_tensor("t.f16", (np.arange(16, dtype=np.float32) / 4).astype(np.float16).reshape(2, 8))
q = np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64)
w.add_tensor("t.q8_0", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
w.add_tensor("t.vec", np.array([1.5, -2.5, 3.5, 0.0], dtype=np.float32))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print("wrote", os.path.join(out, "small.gguf"))
