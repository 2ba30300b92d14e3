"""Write the bundled SmolLM2 GGUF with only its first N layers (device transfer limit): same tokenizer, same types.

    python benchmarks/gpu/truncate_gguf.py SmolLM2-135M-Instruct.Q4_1.gguf small/SmolLM2-135M-Instruct.Q4_1.gguf 4
"""
import sys

import gguf

src, dst, keep = sys.argv[1], sys.argv[2], int(sys.argv[3])
reader = gguf.GGUFReader(src)
arch = reader.fields["general.architecture"].contents()
writer = gguf.GGUFWriter(dst, arch)
for field in reader.fields.values():
    if field.name == "general.architecture" or field.name.startswith("GGUF."):
        continue
    value = keep if field.name == f"{arch}.block_count" else field.contents()
    sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
tensors = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < keep]
for t in tensors:
    writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_ti_data_to_file()
for t in tensors:
    writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
writer.close()
