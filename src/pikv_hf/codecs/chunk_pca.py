"""Block PCA pages: each page (a chunk of ``P`` tokens of one KV head) keeps the mean and top-``r`` principal
directions of its own keys and of its own values, and every token keeps its ``r`` coefficients.

Per page and side: ``mean`` ``[D]`` and ``basis`` ``[r, D]`` (page fields), ``coef`` ``[P, r]`` (slot field), all in
the model dtype; ``x^ = mean + coef @ basis``. Bytes per token: ``r + (D + r * D) / P`` elements per side.
Re-encoding a page (a token joins it, or eviction re-packs it) fits its basis again to the decoded tokens it holds.
"""

from __future__ import annotations

import torch

from pikv_hf.checks import check_int_at_least
from pikv_hf.codecs.base import Codec, PageBatch, as_pages
from pikv_hf.store.pool import FieldSpec

SIDES = ("k", "v")


def page_pca(x: torch.Tensor, valid: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean ``[N, D]``, basis ``[N, r, D]`` (top right singular vectors of the centred valid rows) and coefficients
    ``[N, P, r]`` of pages ``x`` (``[N, P, D]``, rows where ``valid`` ``[N, P]`` is False ignored, coefficients 0)."""
    x = x.float()
    w = valid.unsqueeze(-1).float()
    mean = (x * w).sum(1) / w.sum(1).clamp(min=1)
    centred = (x - mean.unsqueeze(1)) * w
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)  # [N, min(P, D), D]
    basis = vh[:, :rank]
    if basis.shape[1] < rank:  # pages shorter than the rank: the missing directions are zero
        basis = torch.cat([basis, basis.new_zeros(basis.shape[0], rank - basis.shape[1], basis.shape[2])], 1)
    return mean, basis, centred @ basis.transpose(1, 2)


class ChunkPCACodec(Codec):
    """Keys and values as per-page PCA (module docstring), rank ``rank`` per side.

    Parameters
    ----------
    rank : int
        Principal directions kept per page, in ``[1, head_dim]``.
    """

    name = "chunk_pca"
    page_level = True

    def __init__(self, rank: int) -> None:
        check_int_at_least("rank", rank, 1)
        self.rank = rank
        self.dtype = torch.float32

    def fields(self, k_dim: int, v_dim: int, dtype: torch.dtype) -> dict[str, FieldSpec]:
        if not 1 <= self.rank <= min(k_dim, v_dim):
            raise ValueError(f"rank must be in [1, head_dim = {min(k_dim, v_dim)}], got {self.rank}")
        self.dtype = dtype
        out = {}
        for side, dim in zip(SIDES, (k_dim, v_dim), strict=True):
            out[f"{side}_coef"] = FieldSpec((self.rank,), dtype)
            out[f"{side}_mean"] = FieldSpec((dim,), dtype, per_page=True)
            out[f"{side}_basis"] = FieldSpec((self.rank * dim,), dtype, per_page=True)
        return out

    def encode_pages(self, batch: PageBatch) -> dict[str, torch.Tensor]:
        out = {}
        for side, x in zip(SIDES, (batch.keys, batch.values), strict=True):
            mean, basis, coef = page_pca(x, batch.valid, self.rank)
            out.update({f"{side}_coef": coef, f"{side}_mean": mean, f"{side}_basis": basis.flatten(1)})
        return out

    def decode(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for side in SIDES:
            coef = fields[f"{side}_coef"]
            pages, mean, _ = as_pages(coef, fields[f"{side}_mean"])
            basis = fields[f"{side}_basis"].reshape(mean.shape[0], self.rank, mean.shape[-1])
            x = torch.baddbmm(mean.unsqueeze(1).float(), pages.float(), basis.float())
            out.append(x.to(self.dtype).reshape(*coef.shape[:-1], mean.shape[-1]))
        return out[0], out[1]
