"""The model's weights uploaded once, in stored form, with fused QKV and gate/up matrices."""

from __future__ import annotations

import attrs
import numpy as np
from numba import cuda

from ninfer.gpu.cuda.device_weights import DeviceWeight, upload_weight
from ninfer.gpu.cuda.hybrid import is_gdn, upload_gdn_layer
from ninfer.gpu.cuda.kernels.quant_layout import concat_rows, pack_tensor
from ninfer.models.weights import ModelWeights

FLOAT_QTYPES = ("F32", "F16", "BF16")


@attrs.frozen(eq=False)
class DeviceLayer:
    attn_norm: object  # float32 [d] device vectors
    wqkv: tuple[DeviceWeight, ...]  # one fused matrix, or (wq, wk, wv) when their types differ
    bqkv: object | None
    q_norm: object | None
    k_norm: object | None
    wo: DeviceWeight
    ffn_norm: object
    w_gate_up: tuple[DeviceWeight, ...]  # fused, or (w_gate, w_up)
    w_down: DeviceWeight

    @property
    def linears(self) -> tuple[DeviceWeight, ...]:
        return (*self.wqkv, self.wo, *self.w_gate_up, self.w_down)


@attrs.frozen(eq=False)
class DeviceModel:
    embed: DeviceWeight
    head: DeviceWeight
    final_norm: object
    layers: tuple  # DeviceLayer, or hybrid.GdnDeviceLayer for a hybrid's linear-attention layers
    nbytes: int  # bytes of weights on the device

    @property
    def linears_quantized(self) -> bool:
        """Every layer matrix has an int8-activation (dp4a) kernel."""
        return all(w.qtype not in FLOAT_QTYPES for layer in self.layers for w in layer.linears)

    def step_bytes(self, num_sampled: int = 1) -> int:
        """Weight bytes one decode step must read (layers + head; the embedding rows are few)."""
        layers = sum(w.nbytes for layer in self.layers for w in layer.linears)
        return layers + (self.head.nbytes if num_sampled else 0)


def upload_model(spec, weights: ModelWeights, *, stream=0, progress: bool = False) -> DeviceModel:
    """Pack and copy every tensor to the device (tqdm bar over layers when `progress`)."""
    from tqdm import tqdm

    def vec(name):
        return cuda.to_device(np.ascontiguousarray(weights[name].dequantize(), np.float32), stream=stream)

    def fused(names):
        packed = [pack_tensor(weights[n]) for n in names]
        cat = concat_rows(packed)
        return tuple(upload_weight(p, stream) for p in ([cat] if cat is not None else packed))

    def single(name):
        return upload_weight(pack_tensor(weights[name]), stream)

    layers = []
    for i in tqdm(range(spec.num_layers), desc="uploading weights", unit="layer", disable=not progress):
        p = f"layers.{i}."
        if is_gdn(spec, i):  # hybrids' linear-attention layers (gated attention layers: below, wq with its gate rows)
            layers.append(upload_gdn_layer(weights, i, vec, fused, single, stream))
            continue
        layers.append(
            DeviceLayer(
                attn_norm=vec(p + "attn_norm"),
                wqkv=fused([p + "wq", p + "wk", p + "wv"]),
                bqkv=cuda.to_device(
                    np.concatenate([weights[p + b].dequantize() for b in ("bq", "bk", "bv")]).astype(np.float32),
                    stream=stream,
                )
                if spec.has_qkv_bias
                else None,
                q_norm=vec(p + "q_norm") if spec.has_qk_norm else None,
                k_norm=vec(p + "k_norm") if spec.has_qk_norm else None,
                wo=upload_weight(pack_tensor(weights[p + "wo"]), stream),
                ffn_norm=vec(p + "ffn_norm"),
                w_gate_up=fused([p + "w_gate", p + "w_up"]),
                w_down=upload_weight(pack_tensor(weights[p + "w_down"]), stream),
            )
        )
    embed = upload_weight(pack_tensor(weights["embed"]), stream)
    head = embed if spec.tie_embeddings else upload_weight(pack_tensor(weights["lm_head"]), stream)
    nbytes = embed.nbytes + (0 if head is embed else head.nbytes) + sum(w.nbytes for lay in layers for w in lay.linears)
    return DeviceModel(embed=embed, head=head, final_norm=vec("final_norm"), layers=tuple(layers), nbytes=nbytes)
