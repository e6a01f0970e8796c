"""One model run by several threads at once (a threaded translation server): each thread's results equal
the same calls made alone, as stock fairseq's do. An encoding keeps its passes' contexts and cache per
thread (encodings/base.py, `ThreadState`); before, a stack's `begin` in one thread replaced the other's
positions between its layers (rotary: other tokens; FLOATER: a shape error)."""
import sys
import threading

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from test_every_encoding import perturb_away_from_identity
from util import TINY_TRANSFORMER, build_model, random_batch

ENCODINGS = ["rotary", "floater", "t5", "at5", "shaw", "xl", "alibi"]


@pytest.fixture
def switch_often():
    """The interpreter switches threads every microsecond: passes interleave layer by layer."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def model_in_eval(data, encoding):
    torch.manual_seed(0)
    model, task, _ = build_model(data, f"transformer_{encoding}", TINY_TRANSFORMER)
    perturb_away_from_identity(model)
    return model.double().eval(), task


def in_threads(jobs, rounds):
    """Each job called `rounds` times in a thread of its own, all threads at once: every result, by job."""
    results, errors = [[] for _ in jobs], []

    def work(index):
        try:
            for _ in range(rounds):
                results[index].append(jobs[index]())
        except Exception as error:  # (reported by the test, not lost in the thread)
            errors.append(error)
    threads = [threading.Thread(target=work, args=(index,)) for index in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_forward_passes_of_one_model_in_two_threads(translation_data, switch_often, encoding):
    model, task = model_in_eval(translation_data, encoding)
    batches = [random_batch(task.source_dictionary, batch=3, src_len=9, tgt_len=7, seed=1),
               random_batch(task.source_dictionary, batch=2, src_len=30, tgt_len=12, seed=2)]

    def forward(batch):
        with torch.no_grad():
            return model(*batch)[0]
    alone = [forward(batch) for batch in batches]
    together = in_threads([lambda batch=batch: forward(batch) for batch in batches], rounds=10)
    for outputs, expected in zip(together, alone):
        for output in outputs:
            assert torch.equal(output, expected)


@pytest.mark.parametrize("encoding", ["rotary", "floater", "xl"])
def test_beam_search_with_one_model_in_two_threads(translation_data, switch_often, encoding):
    model, task = model_in_eval(translation_data, encoding)
    sources = [random_batch(task.source_dictionary, batch=3, src_len=9, seed=1)[:2],
               random_batch(task.source_dictionary, batch=2, src_len=31, seed=2)[:2]]

    def translate(source, beam):
        generator = SequenceGenerator([model], task.target_dictionary, beam_size=beam, max_len_b=20, min_len=15)
        with torch.no_grad():
            hypotheses = generator.forward({"net_input": {"src_tokens": source[0], "src_lengths": source[1]}})
        return [(h["tokens"].tolist(), h["positional_scores"]) for sentence in hypotheses for h in sentence]
    alone = [translate(sources[0], 3), translate(sources[1], 2)]
    together = in_threads([lambda: translate(sources[0], 3), lambda: translate(sources[1], 2)], rounds=3)
    for translations, expected in zip(together, alone):
        for translation in translations:
            assert [tokens for tokens, _ in translation] == [tokens for tokens, _ in expected]
            for (_, scores), (_, expected_scores) in zip(translation, expected):
                assert torch.equal(scores, expected_scores)


def test_a_model_pickled_before_the_state_was_per_thread_runs(translation_data):
    """A whole model saved by torch.save before ThreadState holds `cache` and `contexts` in its encoding's
    attributes: loaded, its encoding gets a state of its own (before: AttributeError 'contexts')."""
    import copy

    from posenc_fairseq.encodings.cache import EncodingCache

    model, task = model_in_eval(translation_data, "floater")
    batch = random_batch(task.source_dictionary, batch=2, src_len=9, tgt_len=7, seed=1)
    encoding = model.positional_encoding
    with torch.no_grad():
        expected = model(*batch)[0]
    old = {key: value for key, value in encoding.__dict__.items() if key != "thread_state"}
    old.update(cache=EncodingCache(), contexts={})
    encoding.__dict__.clear()
    encoding.__setstate__(copy.copy(old))
    assert "cache" not in encoding.__dict__ and "contexts" not in encoding.__dict__
    with torch.no_grad():
        assert torch.equal(model(*batch)[0], expected)


def test_a_new_thread_reads_the_values_the_others_kept(translation_data):
    """The inference scope is shared by the threads: a call from a thread of its own (a thread per request,
    DataParallel's per-call threads) finds FLOATER's table solved, where with a scope per thread it solved
    it again (docs/benchmarks.md); the output is the same."""
    model, task = model_in_eval(translation_data, "floater")
    batch = random_batch(task.source_dictionary, batch=2, src_len=30, tgt_len=12, seed=2)
    encoding = model.positional_encoding
    with torch.no_grad():
        expected = model(*batch)[0]
    solves = []
    solve = encoding.solve
    encoding.solve = lambda *args, **kwargs: solves.append(args) or solve(*args, **kwargs)

    def call():
        with torch.no_grad():
            return model(*batch)[0]
    [[output]] = in_threads([call], rounds=1)
    assert solves == [] and torch.equal(output, expected)


@pytest.mark.parametrize("encoding", ["floater", "t5", "xl"])
def test_a_decode_keeps_its_values_when_another_thread_finds_the_parameters_changed(translation_data, encoding):
    """The shared scope is replaced, not emptied, by a check that finds the parameters changed: a decode
    of one thread goes on with the values it checked at its start, whatever another thread runs."""
    def later_steps(between):
        model, task = model_in_eval(translation_data, encoding)
        src, src_lengths, prev = random_batch(task.source_dictionary, batch=2, src_len=9, tgt_len=8, seed=3)
        state, outputs = {}, []
        with torch.no_grad():
            encoder_out = model.encoder(src, src_lengths=src_lengths)
            for step in range(prev.size(1)):
                if step == 4:  # parameters changed mid-decode (an update, a load)
                    for parameter in model.positional_encoding.parameters():
                        parameter.mul_(1.5)
                    between(model, (src, src_lengths, prev))
                outputs.append(model.decoder(prev[:, :step + 1], encoder_out=encoder_out, incremental_state=state)[0])
        return torch.cat(outputs[4:], dim=1)

    def forward_in_another_thread(model, batch):
        def call():
            with torch.no_grad():
                return model(*batch)[0]
        in_threads([call], rounds=1)

    alone = later_steps(lambda model, batch: None)
    assert torch.equal(later_steps(forward_in_another_thread), alone)
