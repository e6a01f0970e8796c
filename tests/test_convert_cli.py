"""The conversion scripts' file safety (issue 12): never overwrite without --force, never over files
in SRC's folder, create a missing DST folder, the umask's file mode, and every OS error or bad
option as one `error:` line with exit status 2, no partial file, nothing created, SRC untouched.

The stock checkpoints are tiny fairseq models built in-process and saved in the old `args` format
(fast); most cases call the scripts' `main` in-process, a few run the real scripts."""
import argparse
import copy
import errno
import hashlib
import io
import os
import stat
import subprocess
import sys

import pytest
import torch

import posenc_fairseq  # noqa: F401
from posenc_fairseq import convert, convert_cli
from util import REPO

SCRIPTS = REPO / "scripts"


def stock_state(kind, **options):
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

    if kind == "transformer":
        args = argparse.Namespace(
            arch="transformer", encoder_layers=1, decoder_layers=1, encoder_embed_dim=16, decoder_embed_dim=16,
            encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32, encoder_attention_heads=2, decoder_attention_heads=2,
            max_source_positions=64, max_target_positions=64, **options)
    else:
        args = argparse.Namespace(arch="roberta_base", encoder_layers=1, encoder_embed_dim=16, encoder_ffn_embed_dim=32,
                                  encoder_attention_heads=2, max_positions=64, tokens_per_sample=64)
    ARCH_CONFIG_REGISTRY[args.arch](args)
    torch.manual_seed(0)
    model = ARCH_MODEL_REGISTRY[args.arch].build_model(args, convert._Task(convert._dictionary(24), max_positions=64))
    return {"args": args, "model": model.state_dict(), "optimizer_history": [], "extra_state": {},
            "last_optimizer_state": None}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("stock")
    torch.save(stock_state("transformer"), root / "transformer.pt")
    release = root / "roberta.base"
    release.mkdir()
    torch.save(stock_state("roberta"), release / "model.pt")
    (release / "dict.txt").write_text("".join(f"w{index} 1\n" for index in range(20)))
    return root


@pytest.fixture
def work(sources, tmp_path):
    """A private copy of the sources in tmp_path/src (so every case can check nothing changed)."""
    src = tmp_path / "src"
    (src / "roberta.base").mkdir(parents=True)
    for name in ("transformer.pt", "roberta.base/model.pt", "roberta.base/dict.txt"):
        (src / name).write_bytes((sources / name).read_bytes())
    return tmp_path


def snapshot(root):
    """Every path under root with its content digest and mode."""
    result = {}
    for folder, folders, files in os.walk(root):
        for name in folders + files:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            digest = hashlib.sha256(open(path, "rb").read()).hexdigest() if stat.S_ISREG(info.st_mode) else None
            result[os.path.relpath(path, root)] = (digest, stat.S_IMODE(info.st_mode))
    return result


def run_main(kind, *arguments, capsys):
    """convert_cli.main in-process: (exit status, stdout, stderr)."""
    try:
        status = convert_cli.main(kind, [str(part) for part in arguments])
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def assert_refused(status, err, expected):
    assert status == 2, err
    assert expected in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err


# --- refusals: (kind, arguments relative to the work folder, set-up, expected message) ---------
def _existing_dst(root):
    (root / "out").mkdir()
    (root / "out" / "notes.pt").write_text("an unrelated file\n")


def _dst_parent_is_file(root):
    (root / "blocker").write_text("a file\n")


def _hard_link(root):
    os.link(root / "src" / "transformer.pt", root / "link.pt")


def _src_through_a_link(root):
    (root / "links").mkdir()
    os.symlink("../src/transformer.pt", root / "links" / "model.pt")
    (root / "src" / "notes.pt").write_text("a file beside the real source\n")


REFUSALS = [
    ("existing dst", "transformer", ["src/transformer.pt", "out/notes.pt", "--encoding", "t5"], _existing_dst,
     "exists; refusing to overwrite it (use --force"),
    ("roberta dst = source dict.txt", "roberta", ["src/roberta.base/model.pt", "src/roberta.base/dict.txt", "--encoding", "t5"],
     None, "would be the dictionary"),
    ("transformer dst = file beside src", "transformer", ["src/roberta.base/model.pt", "src/roberta.base/dict.txt",
                                                          "--encoding", "t5"], None, "in SRC's folder"),
    ("file beside src, even with --force", "roberta", ["src/roberta.base/model.pt", "src/roberta.base/dict.txt", "--force"],
     None, "would be the dictionary"),
    ("file beside src reached through a link, with --force", "transformer",
     ["links/model.pt", "src/notes.pt", "--encoding", "t5", "--force"], _src_through_a_link, "in SRC's folder"),
    ("dst is src", "transformer", ["src/transformer.pt", "src/./transformer.pt", "--force"], None, "DST is SRC"),
    ("dst hard link to src", "transformer", ["src/transformer.pt", "link.pt", "--force"], _hard_link, "DST is SRC"),
    ("dst is a folder", "transformer", ["src/transformer.pt", "src", "--encoding", "t5"], None, "is a folder; give the file"),
    ("dst ends with /", "transformer", ["src/transformer.pt", "new/", "--encoding", "t5"], None, "is a folder; give the file"),
    ("dst parent is a file", "transformer", ["src/transformer.pt", "blocker/x/model.pt", "--encoding", "t5"],
     _dst_parent_is_file, "exists and is not a folder"),
    ("src missing", "transformer", ["src/nothing.pt", "out/model.pt"], None, "no such file"),
    ("src is a folder", "roberta", ["src/roberta.base", "out/model.pt"], None, "is a folder; give the checkpoint file"),
    ("bad option: --shaw-k 0", "transformer", ["src/transformer.pt", "new/model.pt", "--encoding", "shaw", "--shaw-k", "0"],
     None, "argument --shaw-k: invalid value '0': expected an integer in [1, 65536]"),
    ("bad option: odd buckets", "roberta", ["src/roberta.base/model.pt", "new/model.pt", "--encoding", "t5",
                                            "--t5-num-buckets", "7"], None, "argument --t5-num-buckets"),
    ("bad option: gamma range", "transformer", ["src/transformer.pt", "new/model.pt", "--encoding", "at5",
                                                "--at5-gamma-range", "10", "1"], None, "expected MIN <= MAX"),
    ("bad option combination", "transformer", ["src/transformer.pt", "new/deeper/model.pt", "--encoding", "t5",
                                               "--t5-max-distance", "3"], None, "--t5-max-distance 3: expected an integer > 16"),
    ("unknown option", "transformer", ["src/transformer.pt", "new/model.pt", "--encoding", "t5", "--t5-bukets", "8"],
     None, "unknown options: --t5-bukets"),
    ("fixed-by-design encoding", "transformer", ["src/transformer.pt", "new/model.pt", "--encoding", "alibi"],
     None, "fixed by design"),
    ("another encoding's option", "transformer", ["src/transformer.pt", "new/model.pt", "--encoding", "t5",
                                                  "--floater-method", "rk4"],
     None, "--floater-method is an option of floater, not of t5 (--encoding), which would not read it"),
    ("lfhc given shaw's k", "roberta", ["src/roberta.base/model.pt", "new/model.pt", "--encoding", "lfhc",
                                        "--shaw-k", "8"], None, "--shaw-k is an option of shaw, not of lfhc"),
    # (before: refused as 'differs from the source by 3.29', not naming the option)
    ("another input embedding", "transformer", ["src/transformer.pt", "new/model.pt", "--encoding", "t5",
                                                "--input-positions", "none"],
     None, "--input-positions none: a converted model keeps the source's input embedding (stock)"),
]


@pytest.mark.parametrize("case,kind,arguments,setup,expected", REFUSALS, ids=[case[0] for case in REFUSALS])
def test_refused_with_one_line_and_nothing_changed(work, monkeypatch, capsys, case, kind, arguments, setup, expected):
    monkeypatch.chdir(work)
    if setup:
        setup(work)
    before = snapshot(work)
    status, _, err = run_main(kind, *arguments, capsys=capsys)
    assert_refused(status, err, expected)
    assert snapshot(work) == before


def test_beside_src_refused_even_with_force(work, monkeypatch, capsys):
    """An existing file in SRC's folder is never replaced (here: a second checkpoint there)."""
    monkeypatch.chdir(work)
    (work / "src" / "other.pt").write_bytes((work / "src" / "transformer.pt").read_bytes())
    before = snapshot(work)
    status, _, err = run_main("transformer", "src/transformer.pt", "src/other.pt", "--encoding", "t5", "--force",
                              capsys=capsys)
    assert_refused(status, err, "is an existing file in SRC's folder; refusing to overwrite files beside the source")
    assert snapshot(work) == before


# --- OS errors while writing: permission, disk full -------------------------------------------
class FullDisk(io.RawIOBase):
    """A file that fails like a full disk after `room` bytes."""

    def __init__(self, path, room=2000):
        self.handle, self.room = open(path, "wb"), room

    def writable(self):
        return True

    def write(self, data):
        self.room -= len(data)
        if self.room < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.handle.write(data)

    def fileno(self):
        return self.handle.fileno()

    def close(self):
        self.handle.close()
        super().close()


def test_disk_full_leaves_nothing(work, monkeypatch, capsys):
    monkeypatch.chdir(work)
    temporaries = []

    def full_disk(folder):
        path = os.path.join(folder, ".convert-test.tmp")
        temporaries.append(path)
        return FullDisk(path), path

    monkeypatch.setattr(convert_cli, "_open_temporary", full_disk)
    before = snapshot(work)
    status, _, err = run_main("transformer", "src/transformer.pt", "new/sub/model.pt", "--encoding", "t5", capsys=capsys)
    assert_refused(status, err, "cannot write new/sub/model.pt: No space left on device")
    assert temporaries and not any(os.path.exists(path) for path in temporaries)
    assert snapshot(work) == before  # the folders new/sub it had created are gone again


def test_permission_denied_leaves_nothing(work, monkeypatch, capsys):
    monkeypatch.chdir(work)

    def denied(folder):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), folder)

    monkeypatch.setattr(convert_cli, "_open_temporary", denied)
    before = snapshot(work)
    status, _, err = run_main("roberta", "src/roberta.base/model.pt", "out/model.pt", "--encoding", "t5", capsys=capsys)
    assert_refused(status, err, "cannot write out/model.pt: Permission denied")
    assert snapshot(work) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder(work, monkeypatch, capsys):
    monkeypatch.chdir(work)
    (work / "locked").mkdir()
    os.chmod(work / "locked", 0o555)
    try:
        status, _, err = run_main("transformer", "src/transformer.pt", "locked/model.pt", "--encoding", "t5", capsys=capsys)
        assert_refused(status, err, "Permission denied")
        assert list((work / "locked").iterdir()) == []
    finally:
        os.chmod(work / "locked", 0o755)


def test_dictionary_copy_failure_removes_the_new_checkpoint(work, monkeypatch, capsys):
    monkeypatch.chdir(work)

    def failing(src, dst):
        raise convert_cli.CLIError("cannot write out/dict.txt: No space left on device")

    monkeypatch.setattr(convert_cli, "copy_dictionary", failing)
    before = snapshot(work)
    status, _, err = run_main("roberta", "src/roberta.base/model.pt", "out/model.pt", "--encoding", "t5", capsys=capsys)
    assert_refused(status, err, "cannot write out/dict.txt")
    assert snapshot(work) == before


# --- what succeeds ----------------------------------------------------------------------------------
def test_creates_missing_folder_with_umask_mode_and_copies_dictionary(work, monkeypatch, capsys):
    """The GLUE README's own example writes roberta.large.floater/model.pt into a new folder."""
    monkeypatch.chdir(work)
    old = os.umask(0o027)
    try:
        before = snapshot(work / "src")
        status, out, err = run_main("roberta", "src/roberta.base/model.pt", "roberta.base.t5/deeper/model.pt",
                                    "--encoding", "t5", capsys=capsys)
    finally:
        os.umask(old)
    assert status == 0, err
    folder = work / "roberta.base.t5" / "deeper"
    assert "wrote roberta.base.t5/deeper/model.pt" in out and "copied dict.txt" in out
    for name in ("model.pt", "dict.txt"):
        assert stat.S_IMODE(os.stat(folder / name).st_mode) == 0o640  # 0o666 & ~0o027, not mkstemp's 0o600
    assert (folder / "dict.txt").read_bytes() == (work / "src" / "roberta.base" / "dict.txt").read_bytes()
    assert sorted(os.listdir(folder)) == ["dict.txt", "model.pt"]  # no temporary file left
    assert snapshot(work / "src") == before
    assert convert.model_namespace(torch.load(folder / "model.pt", map_location="cpu")).arch == "roberta_t5_base"


def test_force_replaces_an_unrelated_file_keeping_its_mode(work, monkeypatch, capsys):
    monkeypatch.chdir(work)
    (work / "out").mkdir()
    target = work / "out" / "model.pt"
    target.write_text("old\n")
    os.chmod(target, 0o600)
    status, _, err = run_main("transformer", "src/transformer.pt", "out/model.pt", "--encoding", "t5", "--force",
                              capsys=capsys)
    assert status == 0, err
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert convert.model_namespace(torch.load(target, map_location="cpu")).arch == "transformer_t5"
    assert sorted(os.listdir(work / "out")) == ["model.pt"]


def test_new_file_beside_src_is_allowed_and_source_files_untouched(work, monkeypatch, capsys):
    monkeypatch.chdir(work)
    before = snapshot(work / "src")
    status, out, err = run_main("roberta", "src/roberta.base/model.pt", "src/roberta.base/model.t5.pt",
                                "--encoding", "t5", capsys=capsys)
    assert status == 0, err
    assert "copied dict.txt" not in out  # the folder has its own dict.txt already: the source's
    after = snapshot(work / "src")
    assert after.pop("roberta.base/model.t5.pt") and after == before


def test_a_dst_that_appears_while_converting_is_not_overwritten_without_force(work, monkeypatch, capsys):
    """DST checked absent before the (slow) conversion, then written by someone else meanwhile: without
    --force the new file is kept and the run refused, no temporary file left; with --force it is replaced."""
    monkeypatch.chdir(work)
    (work / "out").mkdir()
    target = work / "out" / "model.pt"
    real = convert.convert_checkpoint

    def meanwhile(*args, **kwargs):
        target.write_text("written by another process\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(convert, "convert_checkpoint", meanwhile)
    status, _, err = run_main("transformer", "src/transformer.pt", "out/model.pt", "--encoding", "t5", capsys=capsys)
    assert_refused(status, err, "DST out/model.pt appeared while converting; refusing to overwrite it")
    assert target.read_text() == "written by another process\n"
    assert sorted(os.listdir(work / "out")) == ["model.pt"]
    target.unlink()
    status, _, err = run_main("transformer", "src/transformer.pt", "out/model.pt", "--encoding", "t5", "--force",
                              capsys=capsys)
    assert status == 0, err
    assert convert.model_namespace(torch.load(target, map_location="cpu")).arch == "transformer_t5"


def test_an_existing_dictionary_beside_dst_is_left_and_a_different_one_named(work, monkeypatch, capsys):
    """RoBERTa's dict.txt is copied beside DST only where none is there: an identical one is left
    silently, a different one is left with a warning naming both files (the conversion succeeds)."""
    monkeypatch.chdir(work)
    source = (work / "src" / "roberta.base" / "dict.txt").read_bytes()
    for name, content, warned in [("same", source, False), ("other", b"w0 1\n", True)]:
        (work / name).mkdir()
        (work / name / "dict.txt").write_bytes(content)
        status, out, err = run_main("roberta", "src/roberta.base/model.pt", f"{name}/model.pt", "--encoding", "t5",
                                    capsys=capsys)
        assert status == 0, err
        assert (work / name / "dict.txt").read_bytes() == content and "copied dict.txt" not in out
        warning = f"warning: {work / name / 'dict.txt'} exists and differs from {work / 'src' / 'roberta.base' / 'dict.txt'}"
        assert (warning in err) == warned, (name, err)


def test_no_dict_writes_the_checkpoint_alone(work, monkeypatch, capsys):
    """--no-dict: RoBERTa's dict.txt is not copied beside DST (the checkpoint alone is written)."""
    monkeypatch.chdir(work)
    status, out, err = run_main("roberta", "src/roberta.base/model.pt", "out/model.pt", "--encoding", "t5", "--no-dict",
                                capsys=capsys)
    assert status == 0, err
    assert sorted(os.listdir(work / "out")) == ["model.pt"] and "copied dict.txt" not in out


def test_a_checkpoint_in_torchs_legacy_format_converts(work, monkeypatch, capsys):
    """fairseq's older released checkpoints are in torch.save's legacy (pre-zip) format, a pickle that
    starts with 0x80: read as a checkpoint like the zip format, not refused as 'not written by torch.save'."""
    monkeypatch.chdir(work)
    state = torch.load(work / "src" / "transformer.pt", map_location="cpu", weights_only=False)
    torch.save(state, work / "src" / "legacy.pt", _use_new_zipfile_serialization=False)
    assert (work / "src" / "legacy.pt").read_bytes()[:1] == b"\x80"
    status, _, err = run_main("transformer", "src/legacy.pt", "out/model.pt", "--encoding", "t5", capsys=capsys)
    assert status == 0, err
    assert convert.model_namespace(torch.load(work / "out" / "model.pt", map_location="cpu")).arch == "transformer_t5"


# --- the real scripts ----------------------------------------------------------------------------
def script(kind, *arguments, cwd):
    return subprocess.run([sys.executable, str(SCRIPTS / f"convert_{kind}_checkpoint.py"), *map(str, arguments)],
                          capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))


def test_scripts_refuse_and_succeed(work):
    before = snapshot(work)
    done = script("roberta", "src/roberta.base/model.pt", "src/roberta.base/dict.txt", "--encoding", "t5", cwd=work)
    assert_refused(done.returncode, done.stderr, "would be the dictionary")
    done = script("transformer", "src/roberta.base/model.pt", "src/roberta.base/dict.txt", "--force", cwd=work)
    assert_refused(done.returncode, done.stderr, "in SRC's folder")
    assert snapshot(work) == before
    done = script("transformer", "src/transformer.pt", "new/model.pt", "--encoding", "t5", "--t5-num-buckets", "64",
                  cwd=work)
    assert done.returncode == 0, done.stderr
    done = script("transformer", "src/transformer.pt", "new/model.pt", "--encoding", "t5", cwd=work)
    assert_refused(done.returncode, done.stderr, "exists; refusing to overwrite it (use --force")
    assert convert.model_namespace(torch.load(work / "new" / "model.pt", map_location="cpu")).t5_num_buckets == 64


def module(*arguments, cwd):
    return subprocess.run([sys.executable, "-m", "posenc_fairseq.convert_cli", *map(str, arguments)],
                          capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))


@pytest.mark.parametrize("arguments", [["src/transformer.pt", "new/model.pt"], []])
def test_running_the_module_without_a_kind_asks_for_one(work, arguments):
    """`python -m posenc_fairseq.convert_cli SRC DST` (it has no kind) is refused, not a silent exit 0."""
    before = snapshot(work)
    done = module(*arguments, cwd=work)
    assert_refused(done.returncode, done.stderr, "the kind of checkpoint comes first")
    assert "{transformer,roberta,transformer_lm} SRC DST" in done.stderr
    assert done.stdout == "" and snapshot(work) == before
    for asked in (["--help"], ["-h", "transformer"]):
        done = module(*asked, cwd=work)
        assert done.returncode == 0 and "scripts/convert_KIND_checkpoint.py" in done.stdout, done.stderr


def test_the_command_line_knows_the_kinds_conversion_knows():
    assert convert_cli.KINDS == convert.KINDS


def test_the_module_converts_as_the_script_does(work):
    """Where only the package is installed (a wheel has no scripts/), the module is the converter: the same
    checkpoint and the same printed lines as scripts/convert_transformer_checkpoint.py."""
    by_script = script("transformer", "src/transformer.pt", "script/model.pt", "--encoding", "t5", "--t5-num-buckets",
                       "16", cwd=work)
    by_module = module("transformer", "src/transformer.pt", "module/model.pt", "--encoding", "t5", "--t5-num-buckets",
                       "16", cwd=work)
    assert by_script.returncode == by_module.returncode == 0, by_module.stderr
    assert by_module.stdout == by_script.stdout.replace("script/", "module/")
    converted = [torch.load(work / folder / "model.pt", map_location="cpu") for folder in ("script", "module")]
    assert converted[0]["model"].keys() == converted[1]["model"].keys()
    assert all(torch.equal(converted[0]["model"][key], converted[1]["model"][key]) for key in converted[0]["model"])
    done = module("transformer", "--help", cwd=work)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m posenc_fairseq.convert_cli transformer")


# --- the pure function on what fairseq's own loader returns ------------------------------------------
@pytest.mark.parametrize("kind", ["transformer", "roberta"])
def test_converts_fairseqs_loaded_checkpoint_and_leaves_it_untouched(kind, tmp_path):
    """checkpoint_utils.load_checkpoint_to_cpu gives cfg as a DictConfig holding a Namespace cfg.model,
    which deepcopy of the DictConfig shares: the converter must copy it, not write into the source."""
    from fairseq import checkpoint_utils

    saved = stock_state(kind)
    saved["optimizer_history"] = [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                   "lr_scheduler_state": {}, "num_updates": 0}]  # as fairseq-train writes it
    torch.save(saved, tmp_path / "stock.pt")
    state = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "stock.pt"))
    assert isinstance(state["cfg"]["model"], argparse.Namespace)
    before = copy.deepcopy(vars(state["cfg"]["model"]))
    converted = convert.convert_checkpoint(state, kind, "t5")
    assert vars(state["cfg"]["model"]) == before
    assert convert.model_namespace(converted).arch.startswith(f"{kind}_t5")
    assert convert.model_namespace(state).arch == before["arch"]


def test_ema_and_its_fp32_copy_are_dropped(sources):
    """Both cover the source parameters only (fairseq reads ema_fp32_params only beside ema)."""
    state = torch.load(sources / "transformer.pt", map_location="cpu", weights_only=False)
    weights = {key: value.float() for key, value in state["model"].items()}
    state["extra_state"] = {"ema": weights, "ema_fp32_params": weights, "epoch": 3}
    converted = convert.convert_checkpoint(state, "transformer", "t5")
    assert converted["extra_state"] == {"epoch": 3}
    assert set(state["extra_state"]) == {"ema", "ema_fp32_params", "epoch"}


@pytest.mark.parametrize("order", ["options first", "options between", "options last"])
def test_encoding_options_may_stand_anywhere(work, monkeypatch, capsys, order):
    """argparse cannot know that an encoding option takes a value: `--t5-num-buckets 64 SRC DST` read 64
    as SRC. The encoding's options are taken out first, wherever they stand."""
    monkeypatch.chdir(work)
    options = ["--t5-num-buckets", "64", "--encoding", "t5"]
    arguments = {"options first": [*options, "src/transformer.pt", "out.pt"],
                 "options between": ["src/transformer.pt", *options, "out.pt"],
                 "options last": ["src/transformer.pt", "out.pt", *options]}[order]
    status, out, err = run_main("transformer", *arguments, capsys=capsys)
    assert status == 0, err
    assert convert.model_namespace(torch.load(work / "out.pt", map_location="cpu")).t5_num_buckets == 64


@pytest.mark.parametrize("arguments,expected", [
    (["--t5-bukets", "8", "src/transformer.pt", "out.pt", "--encoding", "t5"], "unknown options: --t5-bukets"),
    (["src/transformer.pt", "out.pt", "extra", "--encoding", "t5"], "unexpected arguments: extra")])
def test_what_is_neither_an_option_nor_src_dst_is_named(work, monkeypatch, capsys, arguments, expected):
    monkeypatch.chdir(work)
    before = snapshot(work)
    status, _, err = run_main("transformer", *arguments, capsys=capsys)
    assert_refused(status, err, expected)
    assert snapshot(work) == before


def test_floater_init_small_is_not_reported_as_equal(work, monkeypatch, capsys):
    """--floater-init small moves the dynamics after the identity check: the message says so."""
    monkeypatch.chdir(work)
    status, out, err = run_main("transformer", "src/transformer.pt", "small.pt", "--encoding", "floater",
                                "--floater-init", "small", capsys=capsys)
    assert status == 0, err
    assert "outputs equal to the source before --floater-init small moved the dynamics off zero" in out
    status, out, err = run_main("transformer", "src/transformer.pt", "zero.pt", "--encoding", "floater", capsys=capsys)
    assert status == 0 and out.splitlines()[0].endswith("outputs equal to the source)"), (out, err)


@pytest.mark.parametrize("encoding,options,source", [("t5", ["--t5-num-buckets", "16"], "transformer.pt"),
                                                     ("xl", [], "transformer.pt"), ("t5", [], "prenorm.pt")])
def test_the_printed_options_rebuild_the_converted_model(work, monkeypatch, capsys, encoding, options, source):
    """fairseq-train builds the model for --restore-file / --finetune-from-model from its command line,
    not from the checkpoint: the options the converter prints, and they alone, give a model that loads
    the converted state strictly and computes the source's outputs. (Without --input-positions stock,
    T5's and XL's default input embedding, none, drops stock's sinusoidal one, and the load says nothing;
    before, the source's own options were left to the user, and a pre-norm source left without
    --encoder/decoder-normalize-before loaded strictly into a post-norm model.)"""
    import shlex

    from fairseq import options as fairseq_options
    from fairseq.models import ARCH_MODEL_REGISTRY
    from posenc_fairseq.encodings.option_types import OptionValueError
    from util import USER_DIR

    monkeypatch.chdir(work)
    if source == "prenorm.pt":
        torch.save(stock_state("transformer", encoder_normalize_before=True, decoder_normalize_before=True),
                   work / "src" / source)
    status, out, err = run_main("transformer", f"src/{source}", "out.pt", "--encoding", encoding, *options,
                                capsys=capsys)
    assert status == 0, err
    hint = out.splitlines()[-1]
    assert hint.startswith("to train from it, give fairseq-train: --arch "), out
    given = shlex.split(hint.split(": ", 1)[1])
    assert "--input-positions" in given and all(option in given for option in options)
    source = torch.load(work / "src" / source, map_location="cpu", weights_only=False)
    args = fairseq_options.parse_args_and_arch(fairseq_options.get_training_parser(), [
        str(work), "--task", "translation", "--user-dir", USER_DIR, "--cpu", *given])
    for name in ("encoder_layers", "decoder_layers", "encoder_embed_dim", "decoder_embed_dim", "encoder_ffn_embed_dim",
                 "decoder_ffn_embed_dim", "encoder_attention_heads", "decoder_attention_heads", "max_source_positions",
                 "max_target_positions", "encoder_normalize_before", "decoder_normalize_before", "decoder_output_dim"):
        assert getattr(args, name) == getattr(source["args"], name), name
    assert "--min-params-to-wrap" not in given  # (the source's value is the default)
    task = convert._Task(convert._dictionary(24), max_positions=64)
    rebuilt = ARCH_MODEL_REGISTRY[args.arch].build_model(args, task)
    rebuilt.load_state_dict(torch.load(work / "out.pt", map_location="cpu", weights_only=False)["model"], strict=True,
                            model_cfg=args)
    stock = ARCH_MODEL_REGISTRY["transformer"].build_model(source["args"], task)
    stock.load_state_dict(source["model"])
    tokens = torch.randint(4, 24, (2, 7), generator=torch.Generator().manual_seed(0))
    outputs = [model.eval()(tokens, torch.tensor([7, 7]), tokens[:, :5])[0] for model in (stock, rebuilt)]
    assert (outputs[0] - outputs[1]).abs().max() <= 1e-5
    # without the option the encoding's default (none) would drop the sinusoidal embedding: refused, not
    # silent; --input-positions none, given, drops it as asked
    without = [part for part in given if part not in ("--input-positions", "stock")]
    for chosen in ([], ["--input-positions", "none"]):
        args = fairseq_options.parse_args_and_arch(fairseq_options.get_training_parser(), [
            str(work), "--task", "translation", "--user-dir", USER_DIR, "--cpu", *without, *chosen])
        model = ARCH_MODEL_REGISTRY[args.arch].build_model(args, task)
        weights = torch.load(work / "out.pt", map_location="cpu", weights_only=False)["model"]
        if chosen:
            model.load_state_dict(weights, strict=True, model_cfg=args)
            assert model.encoder.embed_positions is None
        else:
            with pytest.raises(OptionValueError, match=r"^--input-positions none \(the encoding's default\): the "
                                                       r"checkpoint's weights were trained or converted with the stock"):
                model.load_state_dict(weights, strict=True, model_cfg=args)


def test_adaptive_input_and_softmax_lm_converts_to_equal_outputs(tmp_path):
    """The layout of fairseq's released WikiText-103 LMs (adaptive input and adaptive softmax, tied):
    its vocabulary is the sum of the adaptive input's bands. Reference: the stock model itself."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    (tmp_path / "dict.txt").write_text("".join(f"w{index} 1\n" for index in range(26)))  # 30 with the specials
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(tmp_path), "--task", "language_modeling", "--arch", "transformer_lm", "--cpu", "--tokens-per-sample", "64",
        "--decoder-layers", "1", "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32",
        "--decoder-attention-heads", "2", "--decoder-input-dim", "16", "--decoder-output-dim", "16",
        "--adaptive-input", "--adaptive-input-cutoff", "10,20",
        "--adaptive-input-factor", "2", "--adaptive-softmax-cutoff", "10,20", "--adaptive-softmax-factor", "2",
        "--tie-adaptive-weights", "--tie-adaptive-proj"])
    task = tasks.setup_task(args)
    torch.manual_seed(0)
    stock = task.build_model(args).eval()
    with torch.no_grad():
        for parameter in stock.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))  # off the initialisation: every weight matters
    cfg = OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True)
    state = {"cfg": cfg, "args": None, "model": stock.state_dict(), "optimizer_history": [], "extra_state": {},
             "last_optimizer_state": None}
    assert "decoder.embed_tokens.weight" not in state["model"]
    tokens = torch.randint(task.dictionary.nspecial, len(task.dictionary), (2, 20),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = stock.get_normalized_probs(stock(tokens), log_probs=True)
    for encoding in ("floater", "t5"):
        converted = convert.convert_checkpoint(state, "transformer_lm", encoding)
        model, _, _ = convert.load_from_state(converted, "transformer_lm")
        with torch.no_grad():
            found = model.get_normalized_probs(model(tokens), log_probs=True)
        assert type(model) is not type(stock)
        assert (found - expected).abs().max() < 1e-5, encoding


@pytest.mark.parametrize("kind,task,arch,given", [
    ("transformer_lm", "language_modeling", "transformer_lm",
     ["--decoder-layers", "2", "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32", "--dropout", "0.3"]),
    ("transformer_lm", "language_modeling", "transformer_lm_gpt", ["--decoder-layers", "2", "--decoder-learned-pos"]),
    ("roberta", "masked_lm", "roberta_base", ["--encoder-layers", "2", "--encoder-normalize-before"]),
    ("transformer", "translation", "transformer", ["--encoder-layers", "2", "--share-all-embeddings"])])
def test_the_hint_lists_the_options_the_source_was_trained_with(tmp_path, kind, task, arch, given):
    """The training hint lists the source's model options that differ from its architecture's defaults:
    here those of the command line that trained it, as fairseq-train saves its config (cfg). Models with
    a dataclass config (transformer_lm) add their options without defaults; compared with those, every
    option was listed as differing (--min-params-to-wrap 100000000, --character-filters ...)."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(tmp_path), "--task", task, "--arch", arch, "--cpu", *given])
    cfg = OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True)
    listed = convert.source_model_options({"cfg": cfg, "args": None, "model": {}}, kind)
    pairs = lambda line: {(part, line[i + 1] if i + 1 < len(line) and not line[i + 1].startswith("--") else None)
                          for i, part in enumerate(line) if part.startswith("--")}
    assert pairs(listed) == pairs(given), listed


@pytest.mark.parametrize("kind", ["transformer", "roberta"])
def test_a_conversion_stopped_by_sigterm_midway_leaves_nothing(work, kind):
    """SIGTERM (kill, a job scheduler) while the output is being written ends the run as Ctrl-C does:
    the temporary file and the folders the run made are removed, one line says so. The script runs as
    from the command line (its __main__), with torch.save replaced by one that writes part of a file and
    then signals its own process (before: Python's default ended it at once, leaving both)."""
    source = {"transformer": "src/transformer.pt", "roberta": "src/roberta.base/model.pt"}[kind]
    code = (f"import os, runpy, signal, sys, time, torch\n"
            f"save = torch.save\n"
            f"def partial(obj, f, *a, **k):\n"
            f"    if 'model' not in obj:\n"  # (the package's import saves a probe to memory)
            f"        return save(obj, f, *a, **k)\n"
            f"    f.write(b'PK' * 1000); f.flush(); os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)\n"
            f"torch.save = partial\n"
            f"sys.argv = [sys.argv[0], {source!r}, 'out/deep/model.pt', '--encoding', 't5']\n"
            f"runpy.run_path({str(SCRIPTS / f'convert_{kind}_checkpoint.py')!r}, run_name='__main__')\n")
    env = {name: value for name, value in os.environ.items() if name != "POSENC_TEST_FORK_SERVER"}  # (a process of its own)
    done = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith("interrupted; nothing written"), \
        done.stderr[-2000:]
    assert not (work / "out").exists()
