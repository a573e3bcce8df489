"""`miles check-weights A B`: each weight-sync bug it is meant to catch, planted in a tiny checkpoint."""

import json

import pytest

from miles.cli.main import main

Q = "model.layers.0.self_attn.q_proj.weight"  # 64x64: square, so a transpose keeps the shape


def load(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def save(path, tensors):
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def check(capsys, a, b, *flags):
    rc = main(["check-weights", str(a), str(b), *flags])
    out = capsys.readouterr().out
    return rc, out


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A 4-layer tiny Llama, for layer-offset checks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    return save(tmp_path_factory.mktemp("four"), {k: v.detach() for k, v in model.state_dict().items()})


def test_identical_dir_and_file(tiny_model, capsys):
    rc, out = check(capsys, tiny_model, tiny_model / "model.safetensors")
    assert rc == 0, out
    assert out.strip().splitlines()[-1].startswith("Weights match: ")


def test_corrupted_tensor_and_atol(tiny_model, tmp_path, capsys):
    t = load(tiny_model)
    t[Q] = t[Q] + 1e-3
    b = save(tmp_path / "b", t)
    rc, out = check(capsys, tiny_model, b)
    assert rc == 3, out
    assert f"{Q}: values differ" in out and "max abs diff 0.001" in out
    assert "Weights differ: values differ: 1" in out
    rc, out = check(capsys, tiny_model, b, "--atol", "1e-2")
    assert rc == 0 and "Weights match" in out and "within atol 0.01" in out


def test_missing_and_extra(tiny_model, tmp_path, capsys):
    import torch

    t = load(tiny_model)
    del t["model.layers.1.mlp.up_proj.weight"]
    t["model.layers.1.mlp.extra.weight"] = torch.zeros(3)
    rc, out = check(capsys, tiny_model, save(tmp_path / "b", t))
    assert rc == 3
    assert "only in A (missing from B) (1):\n  model.layers.1.mlp.up_proj.weight" in out
    assert "only in B (extra) (1):\n  model.layers.1.mlp.extra.weight" in out


def test_dtype_change(tiny_model, tmp_path, capsys):
    import torch

    t = load(tiny_model)
    t[Q] = t[Q].to(torch.bfloat16)
    rc, out = check(capsys, tiny_model, save(tmp_path / "b", t))
    assert rc == 3
    assert f"{Q}: shape/dtype differs (A float32 [64, 64], B bfloat16 [64, 64], max abs diff" in out


def test_transposed(tiny_model, tmp_path, capsys):
    t = load(tiny_model)
    t[Q] = t[Q].t()
    rc, out = check(capsys, tiny_model, save(tmp_path / "b", t))
    assert rc == 3
    assert f"transposed (1):\n  {Q}: transposed" in out and "values differ" not in out


def shift(tensors, mapping):
    """Rename model.layers.{k} to model.layers.{mapping[k]} (the pipeline-stage numbering bug)."""
    out = {}
    for name, v in tensors.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) in mapping:
            parts[2] = str(mapping[int(parts[2])])
        out[".".join(parts)] = v
    return out


def test_layer_offset(four_layers, tmp_path, capsys):
    import torch

    a = load(four_layers)
    # B's layers 1..3 hold A's layers 0..2; B's layer 0 is something else entirely.
    b = shift(a, {0: 1, 1: 2, 2: 3, 3: 0})
    b = {k: (torch.randn_like(v) if k.startswith("model.layers.0.") else v) for k, v in b.items()}
    rc, out = check(capsys, four_layers, save(tmp_path / "b", b))
    assert rc == 3
    assert "layer offset +1 for layers 0..2 of model.layers (B's layer k+1 holds A's layer k)" in out
    assert "layer 3 of A matches no layer of B (model.layers)" in out
    assert "model.layers.1.self_attn.q_proj.weight" not in out  # explained by the offset, not listed
    assert "model.layers.3.self_attn.q_proj.weight: values differ" in out  # B's 3 is A's 2, A's 3 is gone
    rc, out = check(capsys, four_layers, tmp_path / "b", "--json")
    assert json.loads(out)["layer_offsets"] == [{"stack": "model.layers", "offset": 1, "first": 0, "last": 2}]

    # Every layer renumbered: names only in A / only in B are all explained by one offset.
    rc, out = check(capsys, four_layers, save(tmp_path / "c", shift(a, {k: k + 1 for k in range(4)})))
    assert rc == 3
    assert "layer offset +1 for layers 0..3" in out and "only in" not in out and "unmatched" not in out


def test_layer_offset_onto_layers_that_are_also_in_place(four_layers, tmp_path, capsys):
    a = load(four_layers)
    # B's 0..1 are A's 0..1 (in place) and B's 2..3 are A's 0..1 again; A's 2..3 are gone.
    copies = {k: v.clone() for k, v in a.items() if k.startswith(("model.layers.0.", "model.layers.1."))}
    b = {**a, **shift(copies, {0: 2, 1: 3})}
    rc, out = check(capsys, four_layers, save(tmp_path / "b", b))
    assert rc == 3
    assert "layer offset +2 for layers 0..1 of model.layers (B's layer k+2 holds A's layer k)" in out
    assert "layer 2 of A matches no layer of B (model.layers)" in out and "layer 3 of A matches" in out
    assert ("model.layers.2.self_attn.q_proj.weight: values differ (A float32 [64, 64], B float32 [64, 64], "
            "max abs diff") in out
    assert "; consequence of the layer offset: B's layer 2 holds A's layer 0" in out
    rc, out = check(capsys, four_layers, tmp_path / "b", "--json")
    report = json.loads(out)
    assert report["layer_offsets"] == [{"stack": "model.layers", "offset": 2, "first": 0, "last": 1}]
    assert {f["consequence_of_offset"]["b_layer"] for f in report["values_differ"]} == {2, 3}


def test_no_offsets_from_layers_that_share_tensors(four_layers, tmp_path, capsys):
    a = load(four_layers)
    norm = "model.layers.{}.input_layernorm.weight"
    assert all(a[norm.format(k)].eq(1).all() for k in range(4))  # a fresh model: every norm is all ones
    rc, out = check(capsys, four_layers, save(tmp_path / "same", dict(a)))
    assert rc == 0 and "layer offset" not in out, out
    # Layers 0..2 share their norms (layer 3's are scaled); one linear of layer 1 changes.
    a[norm.format(3)] = a[norm.format(3)] * 2
    b = {**a, "model.layers.1.mlp.up_proj.weight": a["model.layers.1.mlp.up_proj.weight"] + 1}
    rc, out = check(capsys, save(tmp_path / "a", a), save(tmp_path / "b", b))
    assert rc == 3
    assert "layer offset" not in out and "unmatched" not in out and "consequence" not in out, out
    assert "Weights differ: values differ: 1;" in out


def test_no_offsets_from_identical_layers(four_layers, tmp_path, capsys):
    # Every layer the same (identical init): B's extra layer 4 could be any of them.
    a = {k: v for k, v in load(four_layers).items() if not k.startswith("model.layers.")}
    layer0 = {k.removeprefix("model.layers.0."): v for k, v in load(four_layers).items()
              if k.startswith("model.layers.0.")}
    a.update({f"model.layers.{i}.{n}": v.clone() for i in range(4) for n, v in layer0.items()})
    b = {**a, **{f"model.layers.4.{n}": v.clone() for n, v in layer0.items()}}
    rc, out = check(capsys, save(tmp_path / "a", a), save(tmp_path / "b", b))
    assert rc == 3
    assert "layer offset" not in out and "unmatched" not in out, out
    assert f"only in B (extra) ({len(layer0)}):" in out and "model.layers.4.self_attn.q_proj.weight" in out


def test_dropped_buffer(tiny_model, tmp_path, capsys):
    import torch

    t = load(tiny_model)
    a = save(tmp_path / "a", {**t, "model.rotary_emb.inv_freq": torch.arange(8.0)})
    rc, out = check(capsys, a, tiny_model)
    assert rc == 3
    assert "model.rotary_emb.inv_freq: buffer dropped (only in A)" in out and "only in A (missing" not in out


def test_prefix_difference_is_named_and_stripped(tiny_model, tmp_path, capsys):
    t = load(tiny_model)
    b = save(tmp_path / "b", {k.removeprefix("model."): v for k, v in t.items()})
    rc, out = check(capsys, tiny_model, b)
    assert rc == 0, out
    assert "names differ by prefix 'model.' (present in A)" in out and "Weights match" in out


def test_sharded_equals_unsharded(tiny_model, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    rc, out = check(capsys, tiny_model, tmp_path / "sharded")
    assert rc == 0, out
    assert f"Weights match: {len(load(tiny_model))} tensors identical" in out


@pytest.mark.parametrize("a, fragments", [
    ("{tmp}/nope", ["A: ", "nope", "no such file"]),
    ("{tmp}", ["A: ", "no *.safetensors"]),
    ("http://localhost:30000", ["A: ", "put the engine URL second"]),
])
def test_bad_argument_is_one_error_line(tiny_model, tmp_path, capsys, a, fragments):
    rc = main(["check-weights", a.format(tmp=tmp_path), str(tiny_model)])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert all(f in lines[0] for f in fragments), lines[0]


def test_json(tiny_model, tmp_path, capsys):
    t = load(tiny_model)
    t[Q] = t[Q] * 2
    rc, out = check(capsys, tiny_model, save(tmp_path / "b", t), "--json")
    report = json.loads(out)
    assert rc == 3 and report["verdict"] == "differ"
    assert [f["name"] for f in report["values_differ"]] == [Q]
    assert report["identical"] == len(t) - 1 and report["only_in_a"] == []


@pytest.mark.parametrize("n_tensors, lines_read, unbuffered, status", [
    (3000, 1, "", 1),  # a report far bigger than a pipe's buffer: a print meets the closed end, mid-command
    (2, 0, "", 3),  # a short report, reader gone first: the final flush meets it, after the command's status
    (2, 0, "1", 1),  # the same with PYTHONUNBUFFERED: the print meets it
])
def test_output_into_a_closed_pipe_ends_quietly(tmp_path, n_tensors, lines_read, unbuffered, status):
    import os
    import subprocess
    import sys

    import torch

    a = {f"w.{i}": torch.zeros(2) for i in range(n_tensors)}
    save(tmp_path / "a", a)
    save(tmp_path / "b", {k: v + 1 for k, v in a.items()})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | {"PYTHONUNBUFFERED": unbuffered}
    p = subprocess.Popen([sys.executable, "-m", "miles", "check-weights", str(tmp_path / "a"), str(tmp_path / "b")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for _ in range(lines_read):
        assert p.stdout.readline().startswith("A: ")
    p.stdout.close()  # as `| head -1` does
    err = p.stderr.read()
    assert p.wait(timeout=60) == status, err
    assert "BrokenPipeError" not in err and "Traceback" not in err and err == "", err
