"""Programmatic dependent launch (kernels/pdl.py): the switch, and on an sm_90 GPU the decode chain
captured in a CUDA graph with PDL on gives bit for bit what it gives with PDL off."""

import pytest
import torch

from pcg_engine.kernels import pdl


def test_off_on_cpu_whatever_the_switch(monkeypatch):
    monkeypatch.setattr(pdl, "_WANTED", True)
    with pdl.scope():
        assert not pdl.enabled(torch.device("cpu"))
        assert pdl.launch_kwargs(torch.device("cpu")) == {"PDL": False}


def test_only_inside_a_scope(monkeypatch):
    monkeypatch.setattr(pdl, "_WANTED", True)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    cuda = torch.device("cuda", 0)
    assert not pdl.enabled(cuda)
    with pdl.scope():
        with pdl.scope():
            assert pdl.enabled(cuda) and pdl.launch_kwargs(cuda) == {"PDL": True, "launch_pdl": True}
        assert pdl.enabled(cuda)
    assert not pdl.enabled(cuda)


def _decode_layer_chain(x, residual, w):
    """One Qwen3-0.6B decoder layer's kernels at one row, in their order: add + norm + qkv, RoPE
    (with the q/k norms) + KV write, o_proj, add + norm + gate_up, SiLU-and-mul + down_proj."""
    from pcg_engine.attention.rope_kv import rope_and_write_kv
    from pcg_engine.kernels.skinny_gemm import add_rms_norm_linear, linear, silu_mul_linear
    qkv, residual = add_rms_norm_linear(x, residual, w["ln1"], 1e-6, w["qkv"])
    q, k, v = qkv.view(1, -1, 128).split([16, 8, 8], dim=1)
    q = rope_and_write_kv(q, k, v, w["pos"], w["cos_sin"], w["cache"], w["slots"],
                          q_norm=w["qn"], k_norm=w["kn"])
    o = linear(q.reshape(1, -1), w["o"])
    gate_up, residual = add_rms_norm_linear(o, residual, w["ln2"], 1e-6, w["gate_up"])
    return silu_mul_linear(gate_up, w["down"]), residual


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs an sm_90+ GPU")
def test_gpu_pdl_graph_replays_equal_plain_launches(monkeypatch):
    from pcg_engine.kernels.skinny_gemm import tuned_config
    dev, bf = torch.device("cuda"), torch.bfloat16
    for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)):
        if tuned_config(1, n, k) is None:
            pytest.skip(f"no skinny config for ({n}, {k}) at one row: the chain would not run the kernel")
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(bf)
    w = {"ln1": rnd(1024) + 1, "ln2": rnd(1024) + 1, "qn": rnd(128) + 1, "kn": rnd(128) + 1,
         "qkv": rnd(4096, 1024, scale=0.03), "o": rnd(1024, 2048, scale=0.02),
         "gate_up": rnd(6144, 1024, scale=0.03), "down": rnd(1024, 3072, scale=0.02),
         "cos_sin": torch.randn(64, 128, device=dev, generator=g),
         "pos": torch.zeros(1, dtype=torch.long, device=dev), "slots": torch.zeros(1, dtype=torch.long, device=dev)}
    layers = 8
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "_WANTED", on)
        monkeypatch.setattr(pdl, "_depth", 1)   # as inside pdl.scope()
        assert pdl.enabled(dev) == on
        w["cache"] = torch.zeros(2, 4, 16, 8, 128, device=dev, dtype=bf)
        x, residual = torch.zeros(1, 1024, device=dev, dtype=bf), torch.zeros(1, 1024, device=dev, dtype=bf)

        def step():
            h, r = x, residual
            for _ in range(layers):   # the chain eight times, as consecutive layers run it
                h, r = _decode_layer_chain(h, r, w)
            return h, r
        torch.cuda.synchronize()
        step()   # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h, r = step()
        got = []
        for i in range(3):   # new inputs copied into the static buffers before each replay
            gi = torch.Generator(device=dev).manual_seed(100 + i)
            x.copy_(torch.randn(1, 1024, device=dev, generator=gi))
            residual.copy_(torch.randn(1, 1024, device=dev, generator=gi))
            w["pos"].fill_(3 + i)
            w["slots"].fill_(5 + i)
            graph.replay()
            got.append((h.clone(), r.clone(), w["cache"].clone()))
        torch.cuda.synchronize()
        outs[on] = got
    for (h0, r0, c0), (h1, r1, c1) in zip(outs[False], outs[True]):
        assert torch.isfinite(h0.float()).all()
        assert torch.equal(h0, h1) and torch.equal(r0, r1) and torch.equal(c0, c1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs an sm_90+ GPU")
@pytest.mark.parametrize("splits", [1, 16])
def test_gpu_pdl_attention_reads_the_kv_slot_written_just_before(monkeypatch, splits):
    """Decode attention with PDL reads its metadata and prefetches K/V before gdc_wait: each replay
    writes a new token's K/V (RoPE + KV write) that attention must see, at a growing seq_len."""
    from pcg_engine.attention import triton_attention
    from pcg_engine.attention.rope_kv import rope_and_write_kv
    from pcg_engine.attention.torch_backend import paged_attention_reference
    from pcg_engine.attention.triton_attention import unified_attention
    dev, bf = torch.device("cuda"), torch.bfloat16
    monkeypatch.setattr(triton_attention, "PDL_PREFETCH_TILES", 2)   # the name _launch reads
    g = torch.Generator(device=dev).manual_seed(1)
    R, Hq, Hk, D, BS, width = 2, 16, 8, 128, 16, 40
    cache0 = torch.randn(2, 1 + R * width, BS, Hk, D, device=dev, generator=g).to(bf)
    perm = torch.randperm(R * width, device=dev, generator=g) + 1      # shuffled block ids, none 0
    table = perm.view(R, width).to(torch.int32)
    cos_sin = torch.randn(1024, D, device=dev, generator=g)
    qn, kn = (torch.randn(D, device=dev, generator=g) + 1).to(bf), (torch.randn(D, device=dev, generator=g) + 1).to(bf)
    q, k, v = (torch.empty(R, h, D, device=dev, dtype=bf) for h in (Hq, Hk, Hk))
    pos = torch.empty(R, dtype=torch.long, device=dev)
    slots = torch.empty(R, dtype=torch.long, device=dev)
    seq_lens = torch.empty(R, dtype=torch.int32, device=dev)
    qsl = torch.arange(R + 1, dtype=torch.int32, device=dev)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "_WANTED", on)
        monkeypatch.setattr(pdl, "_depth", 1)   # as inside pdl.scope()
        cache = cache0.clone()
        out = torch.empty(R, Hq, D, device=dev, dtype=bf)

        def step():
            q_rot = rope_and_write_kv(q, k, v, pos, cos_sin, cache, slots, q_norm=qn, k_norm=kn)
            unified_attention(q_rot, cache, out, qsl, seq_lens, table, R, 1, D ** -0.5, splits)
            return q_rot

        def set_inputs(i):
            gi = torch.Generator(device=dev).manual_seed(100 + i)
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, device=dev, generator=gi))
            lens = torch.tensor([300 + 7 * i, 517 + 5 * i], device=dev)
            pos.copy_(lens - 1)
            seq_lens.copy_(lens)
            slots.copy_(table.long().gather(1, ((lens - 1) // BS)[:, None])[:, 0] * BS + (lens - 1) % BS)
        set_inputs(0)
        step()   # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            q_rot = step()
        got = []
        for i in range(1, 4):   # new token, new slot, one more key each replay
            set_inputs(i)
            graph.replay()
            ref = torch.empty_like(out)
            paged_attention_reference(q_rot.float(), cache.float(), qsl, seq_lens, table, D ** -0.5, ref)
            torch.cuda.synchronize()
            assert (out.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
            got.append(out.clone())
        outs[on] = got
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs an sm_90+ GPU")
def test_gpu_pdl_moe_down_launch_reads_this_layers_routing(monkeypatch, rel_err):
    """The MoE down launch reads its expert ids, router weights and first expert-row slice before
    gdc_wait (moe_gemv.py: the routing kernel wrote them two launches back; the up launch between
    waits first thing). Four layers of router GEMM -> top-k kernel -> up -> down at Qwen3-30B-A3B's
    shapes in one CUDA graph, replayed with new inputs: with PDL each layer's output equals the one
    without PDL and the fp32 reference of that layer's own routing. A read of the routing before
    its kernel wrote it would see the previous replay's (the same buffers) or garbage."""
    from pcg_engine.kernels import moe_gemv
    from pcg_engine.kernels.fused_moe import fused_moe_ref
    from pcg_engine.kernels.moe_route import topk_softmax
    dev, bf = torch.device("cuda"), torch.bfloat16
    E, D, inter, top_k, n, layers = 128, 2048, 768, 8, 2, 4
    assert moe_gemv.takes_gemv(n, top_k) and moe_gemv.DOWN_PRELOAD > 0
    g = torch.Generator(device=dev).manual_seed(2)
    w13 = (torch.randn(E, 2 * inter, D, device=dev, generator=g) / D ** 0.5).to(bf)
    w2 = (torch.randn(E, D, inter, device=dev, generator=g) / inter ** 0.5).to(bf)
    routers = [(torch.randn(E, D, device=dev, generator=g) / D ** 0.5).to(bf) for _ in range(layers)]
    x = torch.empty(n, D, device=dev, dtype=bf)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "_WANTED", on)
        monkeypatch.setattr(pdl, "_depth", 1)   # as inside pdl.scope()
        assert pdl.enabled(dev) == on

        def step():
            h, seen = x, []
            for w_router in routers:
                weights, ids = topk_softmax(h @ w_router.T, top_k)
                y = moe_gemv.fused_moe_gemv(h, w13, w2, weights, ids)
                seen.append((h, weights, ids, y))
                h = (h + y) * 0.5
            return seen
        x.copy_(torch.randn(n, D, device=dev, generator=g))
        torch.cuda.synchronize()
        step()   # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            seen = step()
        got = []
        for i in range(3):   # new inputs, so each replay routes differently
            x.copy_(torch.randn(n, D, device=dev, generator=torch.Generator(device=dev).manual_seed(100 + i)))
            graph.replay()
            got.append([tuple(t.clone() for t in layer) for layer in seen])
        torch.cuda.synchronize()
        outs[on] = got
    for replay_off, replay_on in zip(outs[False], outs[True]):
        assert torch.equal(replay_off[0][2], replay_on[0][2])   # the first layer's routing, from the same x
        for (_, _, _, y0), (h1, w1, i1, y1) in zip(replay_off, replay_on):
            # (later layers' inputs may differ in their last bits with PDL: the comparison has a tolerance)
            assert rel_err(y1, y0) <= 1e-3
            assert rel_err(y1, fused_moe_ref(h1.float(), w13.float(), w2.float(), w1.float(), i1)) <= 1e-2
    # Replays differ: a launch that read the previous replay's routing would have matched it.
    assert not torch.equal(outs[True][0][0][2], outs[True][1][0][2])
