"""The int8 prefill graph: exact dequantisation of MatMulNBits, close products, and the
ort-cpu engine prefilling through it while decoding with the folder's int4 graph."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx.external_data_helper
import onnx.helper
import onnx.numpy_helper
import onnxruntime as ort
import pytest
from ortserve_runtime import ChatModel, GenerationOptions, ModelConfig, ModelLoadError, ModelRegistry
from ortserve_runtime.engines import _decoder_graph as decoder_graph
from ortserve_runtime.engines import _ort_cpu as ort_cpu
from ortserve_runtime.engines._int8_prefill import _dequantize, cpu_has_vnni, int8_prefill_graph
from serving import TINY_MODEL

pytestmark = pytest.mark.anyio

needs_vnni = pytest.mark.skipif(
    not cpu_has_vnni(), reason="int8 products saturate without VNNI (what prefill_int8 refuses there)"
)


@pytest.fixture
def as_if_vnni(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's VNNI check passes: for tests of the conversion and its cache, which do
    not depend on the products' values (without VNNI these are off, hence refused)."""
    monkeypatch.setattr(ort_cpu, "cpu_has_vnni", lambda: True)


IR = 10  # what the installed onnxruntime reads


@pytest.fixture(autouse=True)
def int8_cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Converted copies go to this test's folder, not the user's cache."""
    monkeypatch.setenv("ORTSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "int8-prefill"


def quantize_int4(weights: np.ndarray, block: int, zero_points: bool) -> tuple[np.ndarray, ...]:
    """(K, N) floats as MatMulNBits wants them: packed nibbles, scales, packed zero points."""
    k, n = weights.shape
    blocks = -(-k // block)
    padded = np.zeros((blocks * block, n), np.float32)
    padded[:k] = weights
    by_block = padded.T.reshape(n, blocks, block)
    if zero_points:
        low, high = by_block.min(-1, keepdims=True), by_block.max(-1, keepdims=True)
        scale = np.maximum(high - low, 1e-6) / 15
        zero = np.clip(np.rint(-low / scale), 0, 15)
    else:
        scale = np.maximum(np.abs(by_block).max(-1, keepdims=True), 1e-6) / 7
        zero = np.full_like(scale, 8)
    q = np.clip(np.rint(by_block / scale + zero), 0, 15).astype(np.uint8)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    zero_flat = zero.reshape(n, blocks).astype(np.uint8)
    if blocks % 2:
        zero_flat = np.concatenate([zero_flat, np.zeros((n, 1), np.uint8)], axis=1)
    zero_packed = (zero_flat[:, 0::2] | (zero_flat[:, 1::2] << 4)).astype(np.uint8)
    return packed, scale.reshape(n, blocks).astype(np.float32), zero_packed


def nbits_node(name: str, inp: str, out: str, weights: np.ndarray, block: int, zero_points: bool) -> tuple:
    k, n = weights.shape
    packed, scales, zeros = quantize_int4(weights, block, zero_points)
    inits = [onnx.numpy_helper.from_array(packed, f"{name}_q"), onnx.numpy_helper.from_array(scales, f"{name}_s")]
    inputs = [inp, f"{name}_q", f"{name}_s"]
    if zero_points:
        inits.append(onnx.numpy_helper.from_array(zeros, f"{name}_z"))
        inputs.append(f"{name}_z")
    node = onnx.helper.make_node(
        "MatMulNBits", inputs, [out], domain="com.microsoft", K=k, N=n, bits=4, block_size=block, accuracy_level=0
    )
    return node, inits


def run_graph(nodes: list, inits: list, x: np.ndarray, n: int) -> np.ndarray:
    graph = onnx.helper.make_graph(
        nodes,
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(x.shape))],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [x.shape[0], n])],
        inits,
    )
    opsets = [onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.microsoft", 1)]
    model = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=IR)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("zero_points", [False, True])
def test_dequantised_weights_are_what_matmulnbits_multiplies_by(zero_points: bool, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    k, n, block = 72, 24, 32  # K not a multiple of the block: the last block is padded
    node, inits = nbits_node("w", "x", "y", rng.standard_normal((k, n)).astype(np.float32), block, zero_points)
    reference = run_graph([node], inits, np.eye(k, dtype=np.float32), n)  # the rows of W
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in inits}
    ours = _dequantize(arrays["w_q"], arrays["w_s"], arrays.get("w_z"), k, n, block)
    np.testing.assert_allclose(ours, reference, atol=1e-6)
    if not cpu_has_vnni():
        return  # the int8 products below saturate (what prefill_int8 refuses there)

    # The int8 graph multiplies by nearly the same matrix.
    opsets = [onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.microsoft", 1)]
    graph = onnx.helper.make_graph([node], "g", [], [], inits)
    converted = int8_prefill_graph(onnx.helper.make_model(graph, opset_imports=opsets), tmp_path, tmp_path / "8.bin")
    assert converted is not None
    assert [node.op_type for node in converted.graph.node] == ["DynamicQuantizeMatMul"]
    onnx.external_data_helper.load_external_data_for_model(converted, str(tmp_path))  # the int8 weights
    x = rng.standard_normal((16, k)).astype(np.float32)
    exact = x @ reference
    approx = run_graph(list(converted.graph.node), list(converted.graph.initializer), x, n)
    assert np.abs(approx - exact).max() < 0.03 * np.abs(exact).max()


def test_a_graph_without_4bit_matrices_has_no_int8_copy(tmp_path: Path) -> None:
    model = onnx.load(str(TINY_MODEL / "model.onnx"), load_external_data=False)  # fp32 MatMuls
    assert int8_prefill_graph(model, TINY_MODEL, tmp_path / "8.bin") is None


def int4_copy_of_tiny(out: Path) -> Path:
    """The tiny fp32 model with its weight MatMuls (those whose B is an initializer) as 4-bit MatMulNBits."""
    shutil.copytree(TINY_MODEL, out)
    model = onnx.load(str(TINY_MODEL / "model.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    for index, node in enumerate(list(model.graph.node)):
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        weights = onnx.numpy_helper.to_array(inits[node.input[1]])
        new, new_inits = nbits_node(f"q{index}", node.input[0], node.output[0], weights, 32, False)
        model.graph.node.remove(node)
        model.graph.node.insert(index, new)
        model.graph.initializer.extend(new_inits)
    (out / "model.onnx").unlink()
    (out / "model.onnx.data").unlink()
    onnx.save(model, str(out / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return out


def counted(run: Callable[..., object], calls: list[object]) -> Callable[..., object]:
    def call(*args: object) -> object:
        calls.append(args)
        return run(*args)

    return call


@needs_vnni
async def test_the_engine_prefills_through_int8_and_decodes_through_int4(tmp_path: Path) -> None:
    folder = int4_copy_of_tiny(tmp_path / "tiny-int4")
    prompt = [(13 * i) % 900 + 20 for i in range(200)]  # long enough for the int8 session
    options = GenerationOptions(max_tokens=8, min_tokens=8, temperature=0)
    results = {}
    for int8 in (False, True):
        registry = ModelRegistry(ModelConfig(prefill_int8=int8, prefix_cache_tokens=0))
        registry.add("tiny", folder)
        model: ChatModel = await registry.get("tiny")
        session = model.engine.prefill_session  # type: ignore[attr-defined]
        assert (session is not None) == int8  # part of the load: its memory is the model's
        assert registry.status_of("tiny").prefill_int8 is int8  # what /v1/models and `ortserve ps` show
        # Off by default (the fast path), and never with int8: one activation scale per call,
        # so what shares a call changes a row's rounding (reproducible with it is refused).
        assert registry.status_of("tiny").reproducible is False
        if int8:
            with pytest.raises(ValueError, match="reproducible cannot be kept with prefill_int8"):
                ModelConfig(prefill_int8=True, prefix_cache_tokens=0, reproducible=True)
        runs: list[object] = []
        if session is not None:
            session.run_with_iobinding = counted(session.run_with_iobinding, runs)
        _, tokens, _, _ = await model.generate(prompt, options=options).collect()
        assert len(runs) == int8  # the prompt went through it in one call; the decode steps did not
        results[int8] = tokens
        await registry.close()
    # Same decode graph, prefill rounded differently: the first tokens agree on this model.
    assert results[True][:4] == results[False][:4], results


async def load_with_int8(folder: Path) -> tuple[ModelRegistry, ChatModel]:
    registry = ModelRegistry(ModelConfig(prefill_int8=True, prefix_cache_tokens=0))
    registry.add("tiny", folder)
    model: ChatModel = await registry.get("tiny")
    assert model.engine.prefill_session is not None  # type: ignore[attr-defined]
    return registry, model


async def test_the_int8_copy_is_cached(tmp_path: Path, int8_cache_in_tmp: Path, as_if_vnni: None) -> None:
    folder = int4_copy_of_tiny(tmp_path / "tiny-int4")
    registry, _ = await load_with_int8(folder)
    await registry.close()
    [copy] = int8_cache_in_tmp.iterdir()
    assert copy.name.startswith("tiny-int4-")
    assert sorted(p.name for p in copy.iterdir()) == ["model.onnx", "model.onnx.data", "source.txt"]
    built = (copy / "model.onnx.data").stat().st_mtime_ns

    registry, _ = await load_with_int8(folder)  # the next load reads it as it is
    await registry.close()
    assert (copy / "model.onnx.data").stat().st_mtime_ns == built
    assert [p.name for p in int8_cache_in_tmp.iterdir()] == [copy.name]  # no partial folder left

    other = int4_copy_of_tiny(tmp_path / "elsewhere" / "tiny-int4")  # the same name, another model
    registry, _ = await load_with_int8(other)
    await registry.close()
    assert len(list(int8_cache_in_tmp.iterdir())) == 2

    os.utime(folder / "model.onnx.data")  # the model changed: a new copy replaces its old one
    registry, _ = await load_with_int8(folder)
    await registry.close()
    copies = list(int8_cache_in_tmp.iterdir())
    assert len(copies) == 2 and copy not in copies


async def test_a_cache_that_cannot_be_written_converts_into_a_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_if_vnni: None
) -> None:
    folder = int4_copy_of_tiny(tmp_path / "tiny-int4")
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("ORTSERVE_CACHE", str(tmp_path / "not-a-folder"))
    registry, model = await load_with_int8(folder)
    _, tokens, _, _ = await model.generate(
        [20 + i for i in range(100)], options=GenerationOptions(max_tokens=4)
    ).collect()
    assert len(tokens) == 4
    await registry.close()


async def test_a_copy_that_cannot_be_made_fails_on_and_is_skipped_by_auto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_if_vnni: None
) -> None:
    folder = int4_copy_of_tiny(tmp_path / "tiny-int4")

    def no_room(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(decoder_graph, "int8_prefill_folder", no_room)
    registry = ModelRegistry(ModelConfig(prefill_int8=True))
    registry.add("tiny", folder)
    with pytest.raises(ModelLoadError, match=r"no int8 copy could be made \(OSError: .*No space left on device"):
        await registry.get("tiny")
    auto = ModelRegistry(ModelConfig(prefill_int8=None))
    auto.add("tiny", folder)
    model: ChatModel = await auto.get("tiny")  # served, prefilling in int4
    assert model.engine.prefill_session is None  # type: ignore[attr-defined]
    await auto.close()


def test_the_down_projection_stays_int4(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    nodes, inits = [], []
    for name, source, target in (("/mlp/up_proj/MatMul", "x", "h"), ("/mlp/down_proj/MatMul", "h", "y")):
        node, node_inits = nbits_node(name.replace("/", "_"), source, target, rng.standard_normal((32, 32)), 32, False)
        node.name = name
        nodes.append(node)
        inits += node_inits
    opsets = [onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.microsoft", 1)]
    converted = int8_prefill_graph(
        onnx.helper.make_model(onnx.helper.make_graph(nodes, "g", [], [], inits), opset_imports=opsets),
        tmp_path,
        tmp_path / "8.bin",
    )
    assert converted is not None
    assert [(n.name.split("/")[-2], n.op_type) for n in converted.graph.node] == [
        ("up_proj", "DynamicQuantizeMatMul"),
        ("down_proj", "MatMulNBits"),
    ]


@pytest.mark.parametrize(
    ("int4", "settings", "words"),
    [
        (False, {}, "has nothing to convert"),  # fp32 matrices
        (True, {"last_position_logits": False}, "has nothing to convert"),
        (True, {"engine": "og-generator"}, "applies to the ort-cpu engine only"),
    ],
)
async def test_prefill_int8_on_is_refused_where_it_cannot_act(
    int4: bool, settings: dict[str, object], words: str, tmp_path: Path
) -> None:
    folder = int4_copy_of_tiny(tmp_path / "tiny-int4") if int4 else TINY_MODEL
    registry = ModelRegistry(ModelConfig(prefill_int8=True, **settings))  # type: ignore[arg-type]
    registry.add("tiny", folder)
    with pytest.raises(ModelLoadError, match=words):
        await registry.get("tiny")
    # auto applies it where it can, and skips this model
    auto = ModelRegistry(ModelConfig(prefill_int8=None, **settings))  # type: ignore[arg-type]
    auto.add("tiny", folder)
    model: ChatModel = await auto.get("tiny")
    assert getattr(model.engine, "prefill_session", None) is None
    await auto.close()


async def test_prefill_int8_on_is_refused_without_vnni(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ort_cpu, "cpu_has_vnni", lambda: False)
    folder = int4_copy_of_tiny(tmp_path / "tiny-int4")
    registry = ModelRegistry(ModelConfig(prefill_int8=True))
    registry.add("tiny", folder)
    with pytest.raises(ModelLoadError, match="needs a CPU with VNNI"):
        await registry.get("tiny")
    auto = ModelRegistry(ModelConfig(prefill_int8=None))  # auto: off on this CPU
    auto.add("tiny", folder)
    model: ChatModel = await auto.get("tiny")
    assert model.engine.prefill_session is None  # type: ignore[attr-defined]
    await auto.close()


def test_prefill_int8_on_an_encoder_model_is_refused() -> None:
    registry = ModelRegistry()
    with pytest.raises(ValueError, match="prefill_int8 applies to generative models only"):
        registry.add("ce", TINY_MODEL.parent / "tiny-cross-encoder", ModelConfig(prefill_int8=True))
