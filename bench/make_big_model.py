"""Builds a Llama of several GiB for the pre-warm bench: random bfloat16 weights (small, so it
generates without NaNs), sharded like a hub model with an index, and the tiny test model's
tokenizer. Run by the real-server environment's Python (numpy, safetensors):
`python make_big_model.py TINY_MODEL OUT_DIR GIB`. Nothing is fetched."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 2048, 5632, 16, 8
SHARD_BYTES = 1024**3


def _bf16(shape: tuple[int, ...], rng: np.random.Generator, scale: float) -> np.ndarray:
    """Random normal values as bfloat16 bits (the upper half of float32), stored as uint16."""
    values = (rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32)
    return (values >> 16).astype(np.uint16)


def main(tiny: Path, out: Path, gib: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((tiny / "config.json").read_text())
    vocab = config["vocab_size"]
    head_dim = HIDDEN // HEADS
    layer = {
        "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
        "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
        "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
    }
    per_layer = sum(int(np.prod(s)) for s in layer.values()) * 2
    layers = max(1, round(gib * 1024**3 / per_layer))
    config.update(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=head_dim,
        num_hidden_layers=layers,
        dtype="bfloat16",
        torch_dtype="bfloat16",
    )
    rng = np.random.default_rng(0)
    tensors: dict[str, tuple[tuple[int, ...], float]] = {
        "model.embed_tokens.weight": ((vocab, HIDDEN), 0.02),
        "model.norm.weight": ((HIDDEN,), 0.0),
        "lm_head.weight": ((vocab, HIDDEN), 0.02),
    }
    for i in range(layers):
        for name, shape in layer.items():
            tensors[f"model.layers.{i}.{name}"] = (shape, 0.0 if len(shape) == 1 else 0.02)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, (shape, scale) in tensors.items():
        if size >= SHARD_BYTES:
            shards.append({})
            size = 0
        # Norms are ones (bfloat16 1.0 is 0x3F80); the rest random.
        data = np.full(shape, 0x3F80, dtype=np.uint16) if scale == 0.0 else _bf16(shape, rng, scale)
        shards[-1][name] = data
        size += data.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        # safetensors' numpy API knows no bfloat16: the file is written as U16, then its header
        # is rewritten to say BF16 (same width, same bytes).
        path = out / fname
        save_file(shard, str(path), metadata={"format": "pt"})
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        meta = json.loads(raw[8 : 8 + n])
        for key, entry in meta.items():
            if key != "__metadata__":
                entry["dtype"] = "BF16"
        header = json.dumps(meta, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data stays 8-byte aligned
        path.write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n :])
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": sum(d.nbytes for s in shards for d in s.values())}}
    index["weight_map"] = weight_map
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)
    if (tiny / "generation_config.json").exists():
        shutil.copy(tiny / "generation_config.json", out / "generation_config.json")
    print(f"{out}: {layers} layers, {index['metadata']['total_size'] / 1024**3:.2f} GiB")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]))
