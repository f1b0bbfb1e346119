"""The engine's measurement and validation hooks: what bench, validate and the self-check call.

Each one runs launch lists of the schedule (schedule.py), never a schedule of its own:
- `kernel_groups`, `prefill_kernel_groups`: one decode step's launches, or one prefill chunk's,
  grouped by stage, for bench to time each group in its own CUDA graph, with the bytes each must
  move; `prefill_chunk_launches`, the chunk's launches in order (dev/prefill_stages.py);
- `probed_step`, `probed_prefill`: one decode step, or one prefill chunk, run eagerly, with what
  each launch wrote copied to the host right after it ran (selfcheck.py checks them in float64);
- `teacher_forced_logits`, `prefill_logits`, `layer_outputs`: logits or one layer's outputs of
  given inputs, through decode steps or through one batched prefill (validate's GPU tiers).
They are declared in backend.GpuEngine. None of them runs while generating; the private buffers
some allocate are allocated when called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from numba import cuda

from ..errors import NanoQwenError
from ..kernels import PAGE_SIZE
from ..kernels.gemm_int4_tiles import covering_rows
from ..kernels.kv_layout import swizzle_rows
from ..sampling import SamplingParams
from .buffers import StepState
from .schedule import DecodeOps, Launch, PrefillOps, forward_launches, layer_launches, run_all

KV_POOLS = ("k_pages", "v_pages")  # writes that are a layer's KV pool: a probe gathers its positions
PROBE_IDS, PROBE_SEED = 4000, 0  # a probe prompt's token ids: random below 4000, as bench's prompts


class KernelGroup(NamedTuple):
    name: str  # the stage and what runs it, e.g. "qkv gemv prmt +rmsnorm"
    enqueue: Callable[[], None]  # makes every launch of this stage one step makes
    launches: int
    bytes: int  # the memory traffic they must cause, reads and writes


def groups_by_stage(launches: list[Launch], stream) -> list[KernelGroup]:
    """The launches grouped by stage, in the order each stage first runs; a group enqueues all of
    its stage's launches (every layer's) on `stream`."""
    stages: dict[str, list[Launch]] = {}
    for launch in launches:
        stages.setdefault(launch.stage, []).append(launch)
    return [KernelGroup(f"{group[0].stage} {group[0].kernel}".rstrip(),
                        lambda group=group: run_all(group, stream), len(group), sum(g.bytes for g in group))
            for group in stages.values()]


class EngineProbes:
    """Mixed into engine.CudaBackend, whose buffers, schedule and stream these methods use."""

    def kernel_groups(self, context: int = 512, method: str = "argmax") -> list[KernelGroup]:
        """One decode step's launches grouped by stage (every layer's, with that layer's weights,
        so the L2 does not keep them), in step order, for timing each group in its own graph.

        They run at position `context` through a private pos and an identity page table, so no
        group needs a sequence; the sampler, which advances its pos at every replay, has a pos of
        its own. RoPE/KV-write does overwrite the K/V slot of position `context` of the first
        pages: time groups between generations. Left out: page_alloc (one thread, once every 16
        steps)."""
        if not 0 <= context < self.max_context:
            raise NanoQwenError(f"context {context} must be below max_context {self.max_context}")
        s = self.stream
        state = dataclasses.replace(self.state, pos=cuda.to_device(np.array([context], np.int32), stream=s),
                                    tokens=cuda.to_device(np.zeros(self.max_context + 1, np.int32), stream=s),
                                    page_table=cuda.to_device(np.arange(self.max_pages, dtype=np.int32), stream=s))
        launches = forward_launches(self._ops(state, context), method, new_page=False)
        sampler_state = dataclasses.replace(state, pos=cuda.to_device(np.zeros(1, np.int32), stream=s))
        launches[-1] = self._ops(sampler_state, context).sampler(method)
        return groups_by_stage(launches, s)

    def prefill_kernel_groups(self, rows: int, method: str = "argmax") -> list[KernelGroup]:
        """One prefill chunk's launches (prefill_chunk_launches) grouped by stage as kernel_groups
        groups a decode step's, for timing each group in its own graph."""
        return groups_by_stage(self.prefill_chunk_launches(rows, method), self.stream)

    def prefill_chunk_launches(self, rows: int, method: str = "argmax", token_ids=None) -> list[Launch]:
        """One prefill chunk's launches, of `rows` prompt tokens from position 0 in their own bucket.
        As in kernel_groups, a private pos, tokens and identity page table, and the chunk's K/V
        written into the first pages (run them between generations); left out: the chunk's
        page_alloc (it would take pages from the free list at every replay).

        The tokens are random ids, as bench's prompts draw them, not one id repeated: the chunk's
        graph on identical rows (token 0 everywhere) ran 6-14% faster than on random ids, which
        take the time to first token's time (docs/PERFORMANCE.md, "2026-12-07, morning").
        `token_ids` (max_context + 1 ids) replaces them, for dev/prefill_stages.py's comparison."""
        if rows not in self.prefill_buckets:
            raise NanoQwenError(f"{rows} rows is not a prefill bucket of this engine ({self.prefill_buckets})")
        s = self.stream
        if token_ids is None:
            token_ids = np.random.default_rng(PROBE_SEED).integers(0, min(self.config.vocab_size, PROBE_IDS),
                                                                   self.max_context + 1)
        state = dataclasses.replace(self.state, pos=cuda.to_device(np.zeros(1, np.int32), stream=s),
                                    tokens=cuda.to_device(np.asarray(token_ids, np.int32), stream=s),
                                    page_table=cuda.to_device(np.arange(self.max_pages, dtype=np.int32), stream=s))
        self.buffers.chunk.copy_to_device(np.array([0, rows], np.int32), stream=s)
        ops = PrefillOps(self.config, self.weights, self.kernels, self.buffers, rows, state=state)
        return [launch for launch in forward_launches(ops, method) if launch.stage != "page_alloc"]

    def _ops(self, state: StepState, context: int) -> DecodeOps:
        return DecodeOps(self.config, self.weights, self.kernels, self.buffers, state=state,
                         context=context)

    def teacher_forced_logits(self, token_ids) -> np.ndarray:
        """float32 logits [len(token_ids), vocab]: row p after running token_ids[0..p] (each step
        is the prompt step, then the final norm and lm_head)."""
        self.reset(token_ids, SamplingParams())
        out = np.empty((len(token_ids), self.config.vocab_size), dtype=np.float32)
        for position in range(len(token_ids)):
            self.step(position, "prompt")
            run_all(self.ops.lm_head(), self.stream)
            self.act.logits.copy_to_host(out[position], stream=self.stream)
        self.stream.synchronize()
        return out

    def prefill_logits(self, token_ids) -> np.ndarray:
        """Like teacher_forced_logits, through batched prefill: the prompt token_ids in chunks
        (eagerly), and each row's final hidden state through the decode head's final norm and
        lm_head, as last_row hands over the last one."""
        self.reset(token_ids, SamplingParams())
        out = np.empty((len(token_ids), self.config.vocab_size), dtype=np.float32)
        s = self.stream
        for start, m, _ in self._chunks(len(token_ids), "prompt"):
            rows = self._bucket(m)
            self.buffers.chunk.copy_to_device(np.array([start, m], np.int32), stream=s)
            run_all(self.prefill_launches(rows, "prompt"), s)
            for row in range(m):
                self.act.h.copy_to_device(self.buffers.prefill[rows].h[row], stream=s)
                run_all(self.ops.lm_head(), s)
                self.act.logits.copy_to_host(out[start + row], stream=s)
        s.synchronize()
        return out

    def layer_outputs(self, layer: int, hidden_states: np.ndarray) -> np.ndarray:
        """Run float32 hidden states [seq, hidden] through decoder layer `layer` alone, as the
        tokens at positions 0..seq-1 (filling that layer's KV cache); returns [seq, hidden]."""
        self.reset([0], SamplingParams())
        x = np.ascontiguousarray(hidden_states, dtype=np.float32)
        out = np.empty_like(x)
        s = self.stream
        for position in range(len(x)):
            run_all(self.ops.page_alloc(position % PAGE_SIZE == 0), s)
            self.act.h.copy_to_device(x[position], stream=s)
            run_all(layer_launches(self.ops, layer), s)
            self.act.h.copy_to_host(out[position], stream=s)
            self.ops.sampler("prompt").run(s)  # pos += 1
            s.synchronize()
        return out

    def probed_step(self, first_token: int, token: int) -> dict:
        """Run first_token at position 0, then token at position 1 (greedy), eagerly, and copy to
        the host what each launch of the second step wrote, right after it ran.

        Returns {(layer or None, stage): {buffer name: host array}}: Launch.writes of that launch,
        the KV pools gathered as k, v [positions 0..1, kv_heads, head_dim].
        """
        self.reset([first_token, token], SamplingParams())
        run_all(self.steps["prompt", True], self.stream)
        return self._probe(self.steps["argmax", False], positions=2)

    def probed_prefill(self, token_ids, rows: int | None = None) -> dict:
        """Run token_ids (at most the longest bucket) as one prefill chunk, greedy, eagerly, in the
        bucket of `rows` rows (default: the smallest that holds them), and copy what each launch
        wrote, as probed_step does; prefill rows cut to len(token_ids)."""
        m = len(token_ids)
        longest = self.prefill_buckets[-1] if self.prefill_buckets else 0
        if not 1 <= m <= longest:
            raise NanoQwenError(f"a probed prefill chunk takes 1..{longest} tokens (engine built with prefill="
                                f"{self.prefill_mode!r}), got {m}")
        rows = self._bucket(m) if rows is None else rows
        if rows not in self.prefill_buckets or rows < m:
            raise ValueError(f"{m} tokens cannot run in a bucket of {rows} rows (buckets {self.prefill_buckets})")
        self.reset(token_ids, SamplingParams())
        self.buffers.chunk.copy_to_device(np.array([0, m], np.int32), stream=self.stream)
        views = self.buffers.prefill[rows]
        return self._probe(self.prefill_launches(rows, "argmax"), positions=m,
                           row_views=[getattr(views, field.name) for field in dataclasses.fields(views)], rows=m)

    def probe_buckets(self, probe_tokens: int, prompt_tokens: int | None = None) -> list[int]:
        """The buckets the self-check runs its chunk of probe_tokens in: the probe's own, then
        those that launch GEMM kernels it does not (gemm_int4_tiles.covering_rows), among the
        buckets a prompt of prompt_tokens runs its chunks in (None: every bucket, as serve
        prepares them all). Buckets smaller than the probe are left out: up to 64 rows every
        linear runs the tiles of the probe's bucket (default_tiles_for)."""
        if not self.prefill_buckets:
            return [None]  # probed_prefill says why no chunk can run
        used = self.prefill_buckets if prompt_tokens is None else \
            {self._bucket(m) for _, m, _ in self._chunks(prompt_tokens, "argmax")}
        first = self._bucket(probe_tokens)
        ms = {first} | {rows for rows in used if rows >= probe_tokens}
        return [first] + [rows for rows in covering_rows(self.config.engine_linears, ms) if rows != first]

    def _probe(self, launches: list[Launch], positions: int, row_views=(), rows: int = 0) -> dict:
        """Run `launches` one by one, copying each one's writes to the host as it finishes."""
        s = self.stream
        captured = {}
        for launch in launches:
            launch.run(s)
            out = {}
            for name, array in launch.writes.items():
                if name in KV_POOLS:
                    out[name[0]] = self._gathered(array, positions)
                else:
                    # Copies into pageable host memory return once done: the next kernel cannot overwrite them.
                    cut = rows and any(array is view for view in row_views)  # a bucket's rows: only the chunk's
                    out[name] = (array[:rows] if cut else array).copy_to_host(stream=s)
            captured[launch.layer, launch.stage] = out
        s.synchronize()
        return captured

    def _gathered(self, pages, positions: int) -> np.ndarray:
        """float16 [positions, kv_heads, head_dim]: the slots of positions 0..positions-1 of one
        layer's pool, found through the page table (only the pages in use are copied), each slot's
        values put back in dim order (kernels/kv_layout.py)."""
        table = self.state.page_table.copy_to_host(stream=self.stream)
        used = -(-positions // PAGE_SIZE)
        copies = swizzle_rows(np.stack([pages[int(page)].copy_to_host(stream=self.stream) for page in table[:used]]))
        _, kv_heads, _, head_dim = copies.shape  # [page, kv head, slot, dim] -> [position, kv head, dim]
        return copies.transpose(0, 2, 1, 3).reshape(-1, kv_heads, head_dim)[:positions]
