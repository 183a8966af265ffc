"""Merging probe files: the merge of disjoint shards equals one collection over all cases (tensor for tensor,
activation moments included, metadata but for provenance, when the shards keep the whole's batches; within float32
noise for the moments otherwise); overlapping, non-comparable and hash-less files are refused; the CLI."""

import itertools
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.modeling import load_model
from rolemrc.probe import ProbeMismatchError, collect, collect_paired, load_probe
from rolemrc.probe.cases import batch_indices, build_cases, case_hash
from rolemrc.probe.counts import fixed_value, read_tensors
from rolemrc.probe.errors import ProbeError
from rolemrc.probe.merge import merge, merge_files

PROVENANCE = {"merged_from"}  # metadata a merge adds; everything else equals one collection's


def assert_same_file(got, want, ignore=PROVENANCE):
    """Two probe files hold the same tensors (keys, dtypes, values) and metadata, but for `ignore`."""
    (meta_got, got_tensors), (meta_want, want_tensors) = (read_tensors(p, "probe file", missing="missing") for p in (got, want))
    assert sorted(got_tensors) == sorted(want_tensors)
    for key, tensor in want_tensors.items():
        assert got_tensors[key].dtype == tensor.dtype and torch.equal(got_tensors[key], tensor), key
    strip = lambda meta: {k: v for k, v in meta.items() if k not in ignore}  # noqa: E731
    assert strip(meta_got) == strip(meta_want)


@pytest.fixture(scope="module")
def llama(model_dirs):
    return load_model(model_dirs["llama"], device="cpu")


@pytest.fixture(scope="module")
def pair(model_dirs):
    return [load_model(model_dirs[arch], device="cpu") for arch in ("llama", "qwen2")]


def collect_parts(pair_or_model, parts, tmp_path, name, batch_size=8, **kw):
    """Collect each part of the records (and all of them: the last path) and save the files."""
    paths = []
    for i, part in enumerate([*parts, [r for p in parts for r in p]]):
        if isinstance(pair_or_model, list):
            probe = collect_paired([m for m, _ in pair_or_model], part, tokenizers=[t for _, t in pair_or_model],
                                   batch_size=batch_size, progress=False, **kw)
        else:
            probe = collect(pair_or_model[0], part, tokenizer=pair_or_model[1], batch_size=batch_size, progress=False, **kw)
        paths.append(probe.save(tmp_path / f"{name}-{i}.safetensors"))
    return paths[:-1], paths[-1]


def batch_aligned(records, tokenizer, cuts, batch_size=8):
    """The records in parts made of whole batches of one collection over all of them (`cuts`: the batch numbers where
    a part ends): each part runs the whole's batches, so every case's activations are the same to the last bit."""
    order = batch_indices(build_cases(records, tokenizer), batch_size)
    bounds = [0, *cuts, len(order)]
    return [[records[i] for i in sorted(i for batch in order[lo:hi] for i in batch)] for lo, hi in itertools.pairwise(bounds)]


@pytest.mark.parametrize("tokens", ["last", "all"])
def test_merge_of_shards_equals_one_collection(llama, pair, records, tmp_path, tokens):
    parts, whole = collect_parts(llama, batch_aligned(records, llama[1], [1, 3]), tmp_path, "one", tokens=tokens)
    assert len(parts) == 3
    assert_same_file(merge_files(parts, tmp_path / "merged.safetensors"), whole)
    shards = batch_aligned(records, llama[1], [2])
    parts, whole = collect_parts(pair, shards, tmp_path, "pair", tokens=tokens)
    merged = merge_files(parts[::-1], tmp_path / "merged-pair.safetensors")  # any order
    assert_same_file(merged, whole)
    assert json.loads(load_probe(merged).meta["merged_from"])[0] == {
        "file": str(parts[1]), "data_fingerprint": load_probe(parts[1]).meta["data_fingerprint"], "cases": len(shards[1])}


def test_merge_of_any_shards_counts_exactly_and_moments_within_float_noise(llama, records, tmp_path):
    """Shards that split the whole's batches pad their cases differently, and a padded batch's activations can differ
    in the last float32 bit: the counts still add up exactly here, the moments within float32 noise."""
    parts, whole = collect_parts(llama, [records[:13], records[13:31], records[31:]], tmp_path, "any", tokens="all")
    merged, one = load_probe(merge_files(parts, tmp_path / "merged.safetensors")), load_probe(whole)
    for d in one.dimensions:
        assert torch.equal(merged.count[d], one.count[d])
        for table in ("act_sum", "act_sq"):
            got, want = (fixed_value(getattr(p, table)[d]).numpy() for p in (merged, one))
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_merge_takes_the_union_of_dimensions(llama, records, tmp_path):
    grouped = [{**r, "group": "x"} for r in records[:10]] + [{**r, "group": "y"} for r in records[10:18]] + records[18:24]
    parts, whole = collect_parts(llama, [grouped[:10], grouped[10:]], tmp_path, "dims", batch_size=1,  # whole batches
                                 dimension_field="group")
    assert load_probe(parts[0]).dimensions == ["x"] and load_probe(whole).dimensions == ["x", "y", "all"]
    assert_same_file(merge_files(parts, tmp_path / "merged.safetensors"), whole)


def test_case_hashes_identify_cases(tokenizer, records):
    cases = build_cases(records, tokenizer)
    assert cases.hashes.dtype == torch.int64 and len(set(cases.hashes.tolist())) == len(records)
    shuffled = build_cases(records[::-1], tokenizer)
    assert shuffled.fingerprint == cases.fingerprint  # a set of cases, in any order
    ids, dims = cases.input_ids[0], ["knowledge_boundary"]
    assert case_hash("t0", ids, dims) != case_hash("t1", ids, dims) != case_hash("t1", ids[:-1], dims)


def test_overlapping_files_are_refused(llama, records, tmp_path):
    (a, b), _ = collect_parts(llama, [records[:25], records[20:]], tmp_path, "overlap")
    with pytest.raises(ProbeError, match=f"{a} and {b} share 5 case"):
        merge([a, b])
    with pytest.raises(ProbeError, match="share 25 case"):
        merge([a, a])


def test_non_comparable_files_are_refused(llama, pair, records, tmp_path):
    model, tok = llama
    half = collect(model, records[:20], tokenizer=tok, progress=False)
    a = half.save(tmp_path / "a.safetensors")
    for name, kw in (("rank", {"rank": "abs"}), ("top_fraction", {"top_fraction": 0.1}), ("tokens", {"tokens": "all"}),
                     ("dimension_field", {"dimension_field": "task"})):
        b = collect(model, records[20:], tokenizer=tok, progress=False, **kw).save(tmp_path / f"{name}.safetensors")
        with pytest.raises(ProbeMismatchError, match=f"{a} and {b} are not comparable.*{name}: "):
            merge([a, b])
    other = collect(pair[1][0], records[20:], tokenizer=tok, progress=False, hook="attn.out")
    llama_attn = collect(model, records[:20], tokenizer=tok, progress=False, hook="attn.out")
    with pytest.raises(ProbeMismatchError, match="model_fingerprint: "):
        merge([llama_attn, other])
    paired = collect_paired([model, pair[1][0]], records[20:], tokenizers=[tok, tok], progress=False)
    with pytest.raises(ProbeMismatchError, match="one model's counts vs a paired file of 2 models"):
        merge([half, paired])
    with pytest.raises(ProbeError, match="two or more"):
        merge([a])


def test_cli_merge(llama, records, tmp_path):
    shards = batch_aligned(records, llama[1], [3])
    parts, whole = collect_parts(llama, shards, tmp_path, "cli")
    res = CliRunner().invoke(app, ["probe", "merge", *map(str, parts), "--out", str(tmp_path / "m.safetensors")])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["merged"] == [str(p) for p in parts] and report["cases"] == load_probe(whole).cases
    assert_same_file(tmp_path / "m.safetensors", whole)
    res = CliRunner().invoke(app, ["probe", "merge", str(parts[0]), str(parts[0]), "--out", str(tmp_path / "x.safetensors")])
    assert res.exit_code == 2 and f"share {len(shards[0])} case" in res.output
