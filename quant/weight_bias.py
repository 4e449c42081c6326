"""Weight bias correction (``QuantConfig.weight_bias_correction``): weight rounding's mean output shift off the bias.

One pass over the calibration batches measures each quantized layer's mean input;
the shift ``(W_q - W) E[x]`` goes into ``QLinear.bias_shift`` or a :class:`BiasShift`
on a weight-only conv's bias.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from softq.calib.data import Batch, run_batches
from softq.quant.layers import BiasShift, QLinear, WeightOnly
from softq.quant.quantizers import dequantized_weight


def _weight_only_convs(qmodel: nn.Module) -> dict[str, nn.Conv2d]:
    return {name: m for name, m in qmodel.named_modules() if isinstance(m, nn.Conv2d)
            and parametrize.is_parametrized(m, "weight") and isinstance(m.parametrizations.weight[0], WeightOnly)}


@torch.no_grad()
def correct_weight_bias(qmodel: nn.Module, batches: list[Batch]) -> int:
    """Weight bias correction (``QuantConfig.weight_bias_correction``); returns how many layers it corrected.

    Rounding a layer's weights to codes moves the mean of its outputs by ``(W_q - W) E[x]``, ``E[x]`` the mean
    input the quantized layer sees on the calibration batches (tokens a batch's ``attention_mask`` marks valid;
    a weight-only ``Conv2d``: over images and positions).  That shift is taken off the bias (Nagel et al. 2019,
    data-free quantization's bias correction, here with the calibration data's mean): ``QLinear.bias_shift``, a
    :class:`~softq.quant.layers.BiasShift` on a conv's bias.  One pass over the batches, all layers at once
    (the means the quantized model sees before any correction); free at run time, it is the bias.
    """
    linears = {name: m for name, m in qmodel.named_modules() if isinstance(m, QLinear)}
    convs = {name: m for name, m in _weight_only_convs(qmodel).items() if m.bias is not None}
    sums: dict[str, list] = {}
    current: dict[str, torch.Tensor | None] = {"mask": None}

    def add(name: str, total: torch.Tensor, count: float) -> None:
        acc = sums.setdefault(name, [0.0, 0.0])
        acc[0], acc[1] = acc[0] + total, acc[1] + count

    def linear_hook(name: str):  # noqa: ANN202 - on the layer's input quantizer: its output is what W_q reads
        def hook(_q: nn.Module, _inp: tuple, out: torch.Tensor) -> None:
            mask = current["mask"]
            rows = out.detach().reshape(-1, out.shape[-1])
            # [batch, seq, ..] or OPT's flattened [batch * seq, ..] feed-forward inputs
            if mask is not None and (tuple(mask.shape) == tuple(out.shape[:-1])
                                     or out.dim() == 2 and mask.dim() == 2 and out.shape[0] == mask.numel()):
                rows = rows[mask.reshape(-1).bool()]
            add(name, rows.sum(0, dtype=torch.float64), float(rows.shape[0]))
        return hook

    errors = {name: (m.weight - m.parametrizations.weight.original).double() for name, m in convs.items()}

    def conv_hook(name: str):  # noqa: ANN202 - the convolution is linear: E[conv(x, dW)] = conv(E_batch[x], dW)
        def hook(m: nn.Conv2d, inp: tuple) -> None:
            x = inp[0].detach().double()
            y = nn.functional.conv2d(x.mean(0, keepdim=True), errors[name], None, m.stride, m.padding, m.dilation,
                                     m.groups)
            add(name, y.mean(dim=(0, 2, 3)) * x.shape[0], float(x.shape[0]))
        return hook

    def batch_mask(_m: nn.Module, _args: tuple, kwargs: dict) -> None:
        current["mask"] = kwargs.get("attention_mask")

    handles = [qmodel.register_forward_pre_hook(batch_mask, with_kwargs=True)]
    handles += [m.input_act.register_forward_hook(linear_hook(n)) for n, m in linears.items()]
    handles += [m.register_forward_pre_hook(conv_hook(n)) for n, m in convs.items()]
    try:
        run_batches(qmodel, batches, desc="weight bias correction")
    finally:
        for h in handles:
            h.remove()
    done = 0
    for name, m in linears.items():
        if name in sums and sums[name][1] > 0:
            mean = sums[name][0] / sums[name][1]
            w = m.weight.detach()
            w_q = None if m.per_channel else m.dequantized_weight()
            shift = torch.empty(w.shape[0], dtype=torch.float64, device=w.device)
            # float64 a block of rows at a time (a 50k-row lm_head whole took two float64 copies and their difference,
            # 6x its float32 size), 8 MiB a copy, a power of two rows (the product's rows come out bit for bit as in
            # blocks of 4096; an odd count did not); per-channel codes: a block's dequantized rows from its rows alone
            step = min(4096, 1 << max(0, (2**20 // w.shape[1]).bit_length() - 1))
            for i in range(0, w.shape[0], step):
                rows = slice(i, i + step)
                piece = dequantized_weight(w[rows], m.weight_bits, True) if w_q is None else w_q[rows]
                shift[rows] = (piece.double() - w[rows].double()) @ mean
            m.bias_shift = (-shift).to(m.weight.dtype)
            done += 1
    for name, m in convs.items():
        if name in sums and sums[name][1] > 0:
            shift = -(sums[name][0] / sums[name][1])
            if parametrize.is_parametrized(m, "bias"):  # corrected before (a second call): a new shift, not two
                m.parametrizations.bias[0].shift = shift.float()
            else:
                parametrize.register_parametrization(m, "bias", BiasShift(shift))
            done += 1
    return done
