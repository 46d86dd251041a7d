"""`tensorserve make-draft`: a self-speculative draft model cut from a target GGUF.

The draft is a real GGUF file: the target's metadata with `<arch>.block_count = N` (per-layer
metadata arrays cut to their first N entries, the tokenizer copied as it is), and the target's
tensors of layers 0..N-1 plus the token embedding, the output norm and the output head (absent
where the model ties it to the embedding, as in the target), in their own GGML types, byte for
byte. It loads as an ordinary model (`tensorserve generate --model FILE`) and, having the target's
vocabulary, serves as its `--draft-model`: its first N layers followed by the final norm and head
are a cheap guess at the target's next token (LayerSkip-style early exit, without training).
"""
from __future__ import annotations

import re
from pathlib import Path

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")


def make_draft(model: str | Path, layers: int, out: str | Path) -> Path:
    """Write the draft of `model` (a GGUF path) keeping its first `layers` layers to `out`."""
    import gguf

    from shared.errors import GGUFError

    src, out = Path(model), Path(out)
    reader = gguf.GGUFReader(src)
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise GGUFError(src, "metadata has no general.architecture")
    arch = arch_field.contents()
    count_key = f"{arch}.block_count"
    count_field = reader.get_field(count_key)
    if count_field is None:
        raise GGUFError(src, f"metadata has no {count_key}")
    total = int(count_field.contents())
    if not 1 <= layers <= total:
        raise ValueError(f"--layers {layers}: {src.name} has {total} layers; accepted: 1..{total}")
    if out.resolve() == src.resolve():
        raise ValueError(f"--out {out} is the model itself")

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch=arch, endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue                              # the writer writes these itself
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == count_key:
            value = layers
        elif field.name == gguf.Keys.General.NAME:
            value = f"{value} draft (first {layers} of {total} layers)"
        elif (field.name.startswith(arch + ".") and vtype == gguf.GGUFValueType.ARRAY
              and isinstance(value, list) and len(value) == total):
            value = value[:layers]                # per-layer hyper-parameters
        writer.add_key_value(field.name, value, vtype, sub_type=sub_type)

    kept = []
    for tensor in reader.tensors:
        m = _LAYER_TENSOR.match(tensor.name)
        if m is None or int(m.group(1)) < layers:
            kept.append(tensor)
    for tensor in kept:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    partial.replace(out)
    return out
