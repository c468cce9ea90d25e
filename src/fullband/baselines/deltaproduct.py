"""A linear-RNN baseline with input-dependent transitions and negative eigenvalues (``model.arch: deltaproduct``):
DeltaProduct (Siems et al. 2025, arXiv 2502.10297) with beta in (0, 2) (Grazzi et al., arXiv 2411.12537), in plain
PyTorch. Its equations and options are in docs/cli.md; like the LSTM it has no latent feedback, and decodes in
standard mode with its states (``DeltaState``) as the cache. Left out of the paper's layers: the short
convolutions on q, k, v and the output gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fullband.baselines.base import BaselineConfig, RecurrentLM, RecurrentState
from fullband.model import MLP, RMSNorm, segment_positions


class DeltaState(RecurrentState):
    """DeltaProductLM's cache: every layer's state S for each row and head, (n_layers, B, n_heads, d, d) with
    d = d_model // n_heads."""

    def __init__(self, config: BaselineConfig, batch_size: int, device: torch.device, dtype: torch.dtype):
        d = config.d_model // config.n_heads
        self.S = torch.zeros(config.n_layers, batch_size, config.n_heads, d, d, device=device, dtype=dtype)


# Tokens per chunk of the chunkwise form: within a chunk the recurrence is one triangular solve over its
# chunk x householder_steps sub-steps, between chunks the state is carried. 32 covers the state-tracking preset's
# training windows in one chunk; the (sub-steps)^2 matrices stay small for long prompts.
CHUNK_TOKENS = 32


def delta_product_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, state: torch.Tensor | None = None,
    keep: torch.Tensor | None = None, chunk: int = CHUNK_TOKENS
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over T tokens. ``q`` (B, T, H, d); ``k``, ``v`` (B, T, n_h, H, d); ``beta`` (B, T, n_h, H);
    ``state`` (B, H, d, d), zero when None; ``keep`` (B, T) bool: False at a document start, where S restarts
    from zero before the token. Returns the outputs S_t q_t (B, T, H, d) and the final state.

    Chunkwise, as DeltaNet's WY form (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule
    over Sequence Length"): the n_h sub-steps of each token are a DeltaNet over n_h x T steps m, and every update
    S <- S - beta (S k - v) k^T adds one rank-one term, so S_m = S_0 + sum_{i <= m} u_i k_i^T with
    u_m = beta_m (v_m - S_0 k_m - sum_{i < m} u_i k_i^T k_m): a unit lower-triangular system for the u of a chunk.
    Documents restart S: a term only reaches steps of its own document, S_0 only those of the document it
    carries. The outputs are the token's last sub-step's S_m q_t."""
    B, T, H, d = q.shape
    n = k.shape[2]
    S = q.new_zeros(B, H, d, d) if state is None else state
    if T == 1 and keep is None:
        # a decode step: its n_h rank-one updates S - beta (S k - v) k^T directly, a third of the chunk's time
        for j in range(n):
            kj, vj, bj = k[:, 0, j], v[:, 0, j], beta[:, 0, j]
            error = (S @ kj.unsqueeze(-1)).squeeze(-1) - vj
            S = S - (bj.unsqueeze(-1) * error).unsqueeze(-1) * kj.unsqueeze(-2)
        return (S @ q[:, 0].unsqueeze(-1)).squeeze(-1).unsqueeze(1), S
    # document index of every token: 0 for the document the initial state belongs to
    doc = torch.zeros(B, T, dtype=torch.long, device=q.device) if keep is None else (~keep).long().cumsum(dim=1)
    carried = torch.zeros(B, 1, dtype=torch.long, device=q.device)  # the document S belongs to
    outputs = []
    for start in range(0, T, chunk):
        stop = min(start + chunk, T)
        L = (stop - start) * n
        # sub-steps in order (token, step): (B, H, L, d) and (B, H, L)
        kc = k[:, start:stop].reshape(B, L, H, d).transpose(1, 2)
        vc = v[:, start:stop].reshape(B, L, H, d).transpose(1, 2)
        bc = beta[:, start:stop].reshape(B, L, H).transpose(1, 2).unsqueeze(-1)
        qc = q[:, start:stop].transpose(1, 2)
        step_doc = doc[:, start:stop].repeat_interleave(n, dim=1)  # (B, L)
        from_state = (step_doc == carried).to(q.dtype)[:, None, :, None]  # (B, 1, L, 1): S_0 reaches the step
        same = step_doc[:, :, None] == step_doc[:, None, :]  # (B, L, L)
        earlier = torch.ones(L, L, dtype=torch.bool, device=q.device).tril(-1)
        A = (kc @ kc.transpose(-1, -2)) * (same & earlier)[:, None].to(q.dtype)
        rhs = bc * (vc - from_state * (kc @ S.transpose(-1, -2)))
        system = torch.eye(L, dtype=A.dtype, device=q.device) + bc * A
        # torch has no half-precision triangular solve: bfloat16 / float16 runs solve in float32
        solve_dtype = torch.float32 if system.dtype in (torch.bfloat16, torch.float16) else system.dtype
        u = torch.linalg.solve_triangular(system.to(solve_dtype), rhs.to(solve_dtype), upper=False,
                                          unitriangular=True).to(rhs.dtype)
        # token t reads after its last sub-step, t * n + n - 1: every sub-step up to it, in its document
        last = torch.arange(n - 1, L, n, device=q.device)
        reach = (torch.arange(L, device=q.device)[None, :] <= last[:, None]) & same[:, last]  # (B, Tc, L)
        outputs.append(from_state[:, :, last] * (qc @ S.transpose(-1, -2))
                       + ((qc @ kc.transpose(-1, -2)) * reach[:, None].to(q.dtype)) @ u)
        # the state after the chunk: the last document's terms, and S_0 if that document is the one it carried
        final_doc = step_doc[:, -1:]
        in_final = (step_doc == final_doc).to(q.dtype)[:, None, :, None]
        S = from_state[:, :, -1:] * S + (u * in_final).transpose(-1, -2) @ kc
        carried = final_doc
    return torch.cat(outputs, dim=2).transpose(1, 2), S


class DeltaProductMixer(nn.Module):
    """The token mixer of one block: n_heads DeltaProduct heads (module docstring) and the output projection."""

    def __init__(self, config: BaselineConfig):
        super().__init__()
        d_model, self.n_heads = config.d_model, config.n_heads
        self.head_dim, self.steps = d_model // config.n_heads, config.householder_steps
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        # Sub-step j's keys, values and betas are slices j of one projection each: one matmul per token block.
        self.k_proj = nn.Linear(d_model, self.steps * d_model, bias=False)
        self.v_proj = nn.Linear(d_model, self.steps * d_model, bias=False)
        self.b_proj = nn.Linear(d_model, self.steps * self.n_heads, bias=False)
        self.o_norm = RMSNorm(self.head_dim, config.norm_eps)  # one gain shared by the heads, as in DeltaNet
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def project(
        self, x: torch.Tensor, write: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, T, H, d), k and v (B, T, n_h, H, d), beta (B, T, n_h, H) of the normed input ``x`` (B, T, D);
        beta = 0 where ``write`` (B, T) is False (padding: S is left exactly as it was)."""
        B, T, _ = x.shape
        H, d, n = self.n_heads, self.head_dim, self.steps
        q = F.normalize(F.silu(self.q_proj(x)).view(B, T, H, d), dim=-1)
        k = F.normalize(F.silu(self.k_proj(x)).view(B, T, n, H, d), dim=-1)
        v = self.v_proj(x).view(B, T, n, H, d)
        # 2 sigmoid: beta in (0, 2), the transition's eigenvalue 1 - beta in (-1, 1) (Grazzi et al.)
        beta = 2 * torch.sigmoid(self.b_proj(x)).view(B, T, n, H)
        if write is not None:
            beta = beta * write[:, :, None, None].to(beta.dtype)
        return q, k, v, beta

    def forward(
        self, x: torch.Tensor, write: torch.Tensor | None, keep: torch.Tensor | None, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, D = x.shape
        q, k, v, beta = self.project(x, write)
        out, S = delta_product_scan(q, k, v, beta, state, keep)
        return self.o_proj(self.o_norm(out).reshape(B, T, D)), S


class DeltaProductBlock(nn.Module):
    def __init__(self, config: BaselineConfig):
        super().__init__()
        self.mixer_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mixer = DeltaProductMixer(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, write: torch.Tensor | None, keep: torch.Tensor | None, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mixed, S = self.mixer(self.mixer_norm(x), write, keep, state)
        x = x + mixed
        return x + self.mlp(self.mlp_norm(x)), S


class DeltaProductLM(RecurrentLM):
    arch = "deltaproduct"
    kind = "a DeltaProduct model"
    state_class = DeltaState

    def __init__(self, config: BaselineConfig):
        super().__init__(config)
        self.layers = nn.ModuleList(DeltaProductBlock(config) for _ in range(config.n_layers))
        self.add_head()
        # Every matrix normal(0, init_std) as in FullBandLM: W_beta x then starts near 0, beta near 1 (eigenvalue
        # near 0), so the model starts from neither decay nor reflection.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=config.init_std)

    def mix(self, x: torch.Tensor, state: DeltaState | None, write: torch.Tensor | None,
            segment_ids: torch.Tensor | None) -> torch.Tensor:
        # Every document but a row's first restarts S (a row's first starts from the zero state anyway: packed
        # documents come without a cache).
        keep = None if segment_ids is None else segment_positions(segment_ids) > 0
        finals = []
        for i, layer in enumerate(self.layers):
            x, S = layer(x, write, keep, None if state is None else state.S[i])
            finals.append(S)
        if state is not None:
            state.S = torch.stack(finals)
        return x
