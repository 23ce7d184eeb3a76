"""Bad command-line values get an exit code and a sentence, never a traceback (issue 11 items 10, 13-15).

Refusals run through Invoke's own ``program`` in this process (fixture ``invoke_here``: same parsing, tasks.py,
exit codes and text); a new process (``inv``) where the process is the point (pipes, signals, ports) and for one
case of each parametrized refusal, as a user runs it."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INVOKE = [sys.executable, "-m", "invoke"]


def inv(*args, **kw):
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([*INVOKE, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120, **kw)


@pytest.mark.parametrize("args, flag", [
    (["build", "--profile", "fp8-h100", "--golden-limit", "abc", "--out", "/nonexistent-dir/x"], "--golden-limit"),
    (["serve", "--repo", "/tmp", "--http-port", "abc"], "--http-port"),
    (["serve", "--repo", "/tmp", "--grpc-port", "99999"], "--grpc-port"),
    (["rollback", "--repo", "/nonexistent/x"], "--repo"),
    (["rollback", "--repo", "/tmp", "--to", ""], "--to"),
    (["bench", "../tasks"], "NAME"),
    (["recommend", "--gpu", "h100", "--measure", "--top", "x"], "--top"),
    (["sensitivity", "--profile", "nvfp4-b200", "--prompts", "x"], "--prompts"),
    (["probe", "--gate", "/nonexistent/gate", "--prompts", "x"], "--prompts"),
    (["compare", "--profiles", ",,", "--out", "/nonexistent-dir/cmp"], "--profiles"),
    (["compare", "--input-len", "abc", "--out", "/nonexistent-dir/cmp"], "--input-len"),
    (["recommend", "--gpu", "h100", "--concurrency", "4", "--request-rate", "1"], "--concurrency"),
    (["recommend", "--gpu", "h100", "--max-tpot", "-1"], "--max-tpot"),
    (["recommend", "--gpu", "h100", "--model", "/nonexistent-dir/model"], "--model"),
    (["compare", "--profiles", "fp8-h100,precision_profiles/fp8-h100.yaml", "--out", "/nonexistent-dir/cmp"], "--profiles"),
])
def test_bad_values_exit_2_with_a_sentence(args, flag, invoke_here):
    p = (inv if args[0] == "build" else invoke_here)(*args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    assert f"{flag}:" in (p.stdout + p.stderr)


def test_check_plans_a_config_only_model(tmp_path, invoke_here):
    """Issue 30: a folder with only config.json is enough to plan (check, compare, recommend); check says the
    build-only rules were skipped."""
    model = ROOT / "tests" / "data" / "models" / "Llama-3.1-8B"
    p = invoke_here("check", "--profile", "fp8-h200", "--model", str(model))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "planned from config.json alone" in p.stdout and "ok fp8-h200" in p.stdout


def test_plan_commands_take_a_config_only_qwen2_72b_and_build_refuses_it(tmp_path):
    """Issue 29: a folder holding only Qwen2.5-72B's config.json: check --all prints a verdict per shipped profile
    and what needs the weights (no fingerprint of a config alone); profiles --gpu plans it; build exits 2 naming
    every missing file."""
    from precision_pipeline.spec.profile import shipped_profiles

    model = tmp_path / "Qwen2.5-72B-Instruct"
    model.mkdir()
    (model / "config.json").write_text((ROOT / "tests" / "data" / "models" / "Qwen2.5-72B-Instruct" / "config.json").read_text())
    p = inv("check", "--all", "--model", str(model))
    assert p.returncode == 2, p.stdout + p.stderr  # some profiles do not fit a 72B: refused, each with its line
    lines = (p.stdout + p.stderr).splitlines()
    for name in shipped_profiles():
        assert sum(ln.startswith((f"ok      {name}: ", f"refused {name}: ")) for ln in lines) == 1, name
    assert "ok      int4-awq-a100: W4A16_AWQ GEMMs" in (p.stdout + p.stderr)
    assert "has no *.safetensors weights" in lines[0] and "planned from config.json alone" in lines[0]
    assert "  needs the weights and tokenizer: model fingerprint: " in (p.stdout + p.stderr)
    assert "cannot build Qwen2ForCausalLM" not in (p.stdout + p.stderr)  # Qwen2 builds since session 9: only the weights are missing
    p = inv("check", "--profile", "int4-awq-a100", "--model", str(model))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "model fingerprint (the key of gate.overrides): needs the weights" in (p.stdout + p.stderr)
    assert "gate bar: the profile's own (a gate.overrides entry is found by the fingerprint" in (p.stdout + p.stderr)
    p = inv("profiles", "--gpu", "h200", "--model", str(model))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "runs     int4-awq-a100: W4A16_AWQ GEMMs, NONE KV on h200" in (p.stdout + p.stderr)
    p = inv("compare", "--profiles", "int4-awq-a100,bf16-h100", "--model", str(model), "--out", str(tmp_path / "cmp"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "planned from config.json alone" in (p.stdout + p.stderr) and "needs the weights: gate numbers" in (p.stdout + p.stderr)
    assert "cannot run bf16-h100" in (p.stdout + p.stderr) and (tmp_path / "cmp" / "compare.json").is_file()
    p = inv("build", "--profile", "int4-awq-a100", "--model", str(model), "--out", str(tmp_path / "out"))
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr
    assert "has no *.safetensors weights (only safetensors are loaded) and no tokenizer" in (p.stdout + p.stderr)
    assert not (tmp_path / "out").exists()


def test_markup_in_messages_is_printed_verbatim(tmp_path, invoke_here):
    """rich must not eat the name pattern's brackets nor user text such as [bold red]h100[/]."""
    prof = tmp_path / "p.yaml"
    prof.write_text("name: 'Bad Name'\ntarget:\n  gpu: '[bold red]h100[/]'\n")
    p = invoke_here("check", "--profile", str(prof))
    assert p.returncode == 2
    assert "[a-z0-9][a-z0-9._-]*" in (p.stdout + p.stderr)


def test_releases_into_a_closed_pipe_is_quiet(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()  # a serving repository: releases.json beside it (`releases` refuses a folder without one)
    (tmp_path / "releases.json").write_text('{"current": "tensorrt_llm_000000000001", "releases": [], "history": []}')
    p = subprocess.run(f"{sys.executable} -m invoke releases --repo {repo} | head -c 1", shell=True, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr


def _busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def test_serve_refuses_a_port_in_use(tmp_path):
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.serving.triton_server import serve

    (tmp_path / "repo").mkdir()
    s = _busy_port()
    try:
        with pytest.raises(UserError) as ei:
            serve(tmp_path / "repo", http_port=s.getsockname()[1], grpc_port=0 or _free(), metrics_port=_free())
        assert ei.value.problems[0].field == "--http-port"
        assert f"{s.getsockname()[1]} (--http-port)" in ei.value.message
    finally:
        s.close()


def _free():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_serve_takes_the_server_down_when_the_task_dies(tmp_path, how):
    """A real tritonserver (empty repository) started by `invoke serve`: after SIGTERM or kill -9 of the
    task, nothing answers on its port any more (no orphan)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    ports = [_free(), _free(), _free()]
    proc = subprocess.Popen([*INVOKE, "serve", "--repo", str(repo), "--http-port", str(ports[0]), "--grpc-port",
                             str(ports[1]), "--metrics-port", str(ports[2])], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not _answers(ports[0]):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.5)
        proc.send_signal(how)
        proc.wait(60)
        deadline = time.monotonic() + 60
        while _answers(ports[0]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _answers(ports[0]), f"tritonserver still answers on {ports[0]} after the task got {how!r}"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC, errno.EACCES])
def test_unwritable_output_is_a_sentence_not_a_traceback(err, capsys):
    """A read-only or full disk under --out (as root, chmod cannot simulate it: the error is raised
    where the write would fail) ends with exit 2 and one sentence."""
    import importlib.util

    from invoke import Exit

    spec = importlib.util.spec_from_file_location("tasks_under_test", ROOT / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)

    @tasks.guarded
    def job():
        raise OSError(err, os.strerror(err), "/srv/out/.checkpoint.tmp-1/rank0.safetensors")

    with pytest.raises(Exit) as ei:
        job()
    out = capsys.readouterr()
    assert ei.value.code == 2
    assert "cannot write /srv/out/.checkpoint.tmp-1/rank0.safetensors" in out.err and "intact" in out.err
    assert "Traceback" not in out.out + out.err


@pytest.mark.parametrize("margin", ["-1", "0", "1.5", "nan"])
def test_margin_outside_0_1_names_the_range(margin, invoke_here):
    p = (inv if margin == "nan" else invoke_here)("sensitivity", "--profile", "nvfp4-b200", "--margin", margin, "--out", "/nonexistent-dir/s")
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr
    assert "--margin:" in (p.stdout + p.stderr) and "is not in (0, 1]" in (p.stdout + p.stderr)


@pytest.mark.parametrize("target, says", [("t.txt", "does not end in .yaml"), ("f.yaml/t.yaml", "is a file, not a folder"),
                                          ("mine.yaml", "not written by invoke"),
                                          ("My Profile.yaml", "name the file e.g. my-profile.yaml")])
def test_bad_write_profile_target_is_refused_before_measuring(tmp_path, target, says, invoke_here):
    (tmp_path / "f.yaml").write_text("x")
    (tmp_path / "mine.yaml").write_text("extends: fp8-h100\n")
    p = invoke_here("sensitivity", "--profile", "fp8-h100", "--out", str(tmp_path / "empty"), "--write-profile",
                    str(tmp_path / target))
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr
    assert "--write-profile:" in (p.stdout + p.stderr) and says in (p.stdout + p.stderr)  # not the missing checkpoint of --out: nothing was measured
    assert not (tmp_path / "empty").exists()


def test_a_full_disk_names_the_stage_folder_and_efbig_names_ulimit(tmp_path, capsys):
    """Issue 25 item 21: full-disk errors printed an empty path (write() names no file); ``ulimit -f`` (EFBIG) was
    an internal error."""
    import importlib.util

    from invoke import Exit

    from precision_pipeline.core.stage import Artifact, Frozen, Stage, execute

    spec = importlib.util.spec_from_file_location("tasks_under_test", ROOT / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)

    class In(Frozen):
        n: int

    class Fills(Stage):
        name, output, artifact_type = "quantize", "checkpoint", Artifact

        def inputs(self, plan, request, upstream):
            return In(n=1)

        def run(self, inputs, workdir):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write() raises it: no file name

    @tasks.guarded
    def build():
        execute(Fills(), None, None, {}, tmp_path)

    with pytest.raises(Exit) as ei:
        build()
    out = "".join(capsys.readouterr())
    assert ei.value.code == 2 and f"cannot write {tmp_path / 'checkpoint'}: No space left on device" in out, out

    @tasks.guarded
    def big():
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG), "/src/rank0.safetensors", None, "/srv/out/x/rank0.safetensors")

    with pytest.raises(Exit) as ei:
        big()
    out = capsys.readouterr()
    assert ei.value.code == 2 and "cannot write /srv/out/x/rank0.safetensors: File too large" in out.err
    assert "ulimit -f" in out.err and "Traceback" not in out.out + out.err


def test_a_safetensors_write_past_the_file_size_limit_is_exit_2_naming_the_stage_folder(tmp_path):
    """Hostile s15 F4: ModelOpt's checkpoint export writes with safetensors, whose ``SafetensorError`` ("I/O error: File
    too large (os error 27)") is no OSError: under ``ulimit -f`` (or on a full disk, os error 28) the build was an
    internal error with a traceback. A real safetensors write in a stage under a 1 MiB file-size limit (Python
    ignores SIGXFSZ, so the write fails with EFBIG) is now exit 2 naming the stage folder; the folder is not left."""
    code = f"""
import resource, sys
sys.path.insert(0, {str(ROOT / 'build')!r}); sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
import torch
from safetensors.torch import save_file
from precision_pipeline.core.errors import exit_code_for, error_text
from precision_pipeline.core.stage import Artifact, Frozen, Stage, execute

class In(Frozen):
    n: int

class Writes(Stage):
    name, output, artifact_type = "quantize", "checkpoint", Artifact
    def inputs(self, plan, request, upstream):
        return In(n=1)
    def run(self, inputs, workdir):
        save_file({{"w": torch.zeros(1 << 20)}}, str(Path(workdir) / "rank0.safetensors"))  # 4 MiB

resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
try:
    execute(Writes(), None, None, {{}}, Path({str(tmp_path)!r}))
except BaseException as e:
    print(exit_code_for(e), type(e).__name__, type(e.__cause__).__name__, error_text(e))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.startswith(f"2 OSError SafetensorError cannot write {tmp_path / 'checkpoint'}: File too large."), \
        p.stdout + p.stderr
    assert not (tmp_path / "checkpoint").exists() and [x.name for x in tmp_path.iterdir() if "tmp" in x.name] == []


def test_min_prompts_above_the_golden_set_is_refused_with_the_numbers(tmp_path, invoke_here):
    """Hostile round #12: `gate.min_prompts: 1000` passed `check` although the golden set has 65 prompts (every
    build of the profile would then be unpromotable)."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.gate.verdict import load_build_profile

    for n, ok in ((1000, False), (66, False), (65, True)):
        p = tmp_path / f"mp{n}.yaml"
        p.write_text(f"extends: fp8-h100\nname: mp-{n}\ngate:\n  min_prompts: {n}\n")
        if ok:
            assert load_build_profile(str(p)).gate.min_prompts == 65
            continue
        with pytest.raises(UserError) as ei:
            load_build_profile(str(p))
        pr = ei.value.problems[0]
        assert pr.field == "gate.min_prompts" and f"is {n:,} but the golden set has 65 prompts (facts 11," in pr.reason
        assert "at most 65" in pr.fix
    r = invoke_here("check", "--profile", str(tmp_path / "mp1000.yaml"))
    assert r.returncode == 2 and "gate.min_prompts:" in (r.stdout + r.stderr) and "Traceback" not in r.stdout + r.stderr


@pytest.mark.parametrize("args", [["build", "--help"], ["build", "-h"], ["promote", "--help"], ["recommend", "-h"]])
def test_help_after_a_task_with_a_positional_argument_is_its_help(args, invoke_here):
    """Hostile round: `invoke build --help` was refused as the profile name '--help' (Invoke gives a task's missing
    positional argument the next token, --help included); it prints the task's help, as `invoke --help build`."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=root, capture_output=True, text=True, timeout=120)
    want = invoke_here("--help", args[0])  # what Invoke prints for `invoke --help TASK`
    assert r.returncode == 0 and r.stdout == want.stdout and "Usage:" in r.stdout, r.stdout + r.stderr
    assert "refused" not in r.stdout + r.stderr


@pytest.mark.parametrize("args, flag", [
    (["build", "--profile", "no-such-profile-x", "--out", ""], "--out"),       # was: a whole build into artifacts/<profile>
    (["build", "--profile", "no-such-profile-x", "--model", " "], "--model"),  # was: '--model:  is not a ...' (no name)
    (["promote", "--profile", "no-such-profile-x", "--repo", ""], "--repo"),   # was: a promote into the default repository
    (["promote", "--profile", "no-such-profile-x", "--out", ""], "--out"),
    (["rollout", "--profile", "no-such-profile-x", "--out", ""], "--out"),
    (["releases", "--repo", ""], "--repo"),
    (["serve", "--repo", "", "--http-port", "1", "--grpc-port", "1"], "--repo"),
    (["nightly", "--profiles", "no-such-profile-x", "--out", ""], "--out"),
    (["recommend", "--gpu", "no-such-gpu-x", "--model", ""], "--model"),
])
def test_an_empty_path_flag_is_refused_not_its_default(args, flag, invoke_here):
    """Issue 25 items 18/21 (found re-trying them): ``--out ''`` / ``--repo "$UNSET"`` silently meant the default
    (``build --out ''`` built artifacts/<profile>, ``promote --repo ''`` promoted into the default repository), as
    ``--to ''`` did before it was refused. Refused by ``guarded`` before the task runs (tasks.PATH_FLAGS)."""
    r = invoke_here(*args)
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert f"{flag}: is empty (" in (r.stdout + r.stderr) and "an unset shell variable?" in (r.stdout + r.stderr), (r.stdout + r.stderr)
    assert f"leave {flag} out for its default" in (r.stdout + r.stderr)


def test_a_folder_where_a_file_is_written_is_exit_2_naming_it(tmp_path, invoke_here):
    """Found re-trying issue 25 item 17: ``mkdir <out>/manifest.json`` in a build output, then ``build``: an
    IsADirectoryError traceback (exit 1) from the atomic replace. EISDIR/ENOTDIR are the user's machine (exit 2,
    the file named, what to remove), as a full disk is (core/errors.USER_OS_ERRNOS)."""
    from precision_pipeline.core.errors import exit_code_for, os_error_text
    from precision_pipeline.core.outputs import write_output_marker

    out = tmp_path / "out"
    (out / "manifest.json").mkdir(parents=True)
    write_output_marker(out, "fp8-h100")
    r = invoke_here("build", "--profile", "fp8-h100", "--out", str(out), "--no-wait")
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    text = " ".join((r.stdout + r.stderr).split())
    assert f"cannot use {out / 'manifest.json'}: Is a directory" in text, text
    assert "a folder stands where this file is written: remove that folder if it is not yours" in text
    e = NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), "/srv/out/plan.json/x")
    assert exit_code_for(e) == 2 and "a file stands where a folder of that path is expected" in os_error_text(e)


REFUSED = "error: the input was refused; nothing was changed.\n"


@pytest.mark.parametrize("args, said", [
    (["check", "--profile"], "  --profile: is given without a value (an unset shell variable, or the flag last on the "
     "line?).\n    fix: pass a value (e.g. --profile VALUE; quote a variable: --profile \"$VAR\"), or leave --profile out.\n"),
    (["profiles", "--gpu"], "  --gpu: is given without a value"),
    (["releases", "--repo"], "  --repo: is given without a value"),
    (["nightly", "--profiles"], "  --profiles: is given without a value"),
    (["build", "--profile", "--out", "x"], "  --profile: is given without a value (an unset shell variable, or the flag "
     "last on the line?).\n    fix: pass a value (e.g. --profile VALUE; quote a variable: --profile \"$VAR\").\n"),
    (["build"], "  --profile: is required.\n    fix: see `invoke --help build`.\n"),
    (["check", "--frob"], "  --frob: is not a flag of `invoke check`.\n    fix: see `invoke --help check`.\n"),
])
def test_a_command_line_invoke_refuses_is_exit_2_naming_the_flag(args, said, invoke_here):
    """Hostile round s11 F7: a flag without a value (``--profile $UNSET`` unquoted) got Invoke's own "Flag <Argument:
    profile (p)> needed value and was not given one!" and exit 1, which the README keeps for internal errors. Every
    refusal of Invoke's parser is exit 2 with the flag, the reason and the fix (tasks.parse_refusal)."""
    r = invoke_here(*args)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith(REFUSED + said), r.stdout + r.stderr  # F-J: stderr


def test_a_flag_without_a_value_is_exit_2_in_a_real_process():
    """The same through ``python -m invoke`` (what ``./run.sh`` and the ``invoke`` command run): the hook sits on
    Invoke's own program instance, installed when tasks.py is loaded."""
    r = inv("releases", "--repo")
    assert r.returncode == 2 and (r.stdout + r.stderr) == (REFUSED + "  --repo: is given without a value (an unset shell variable, "
                                              "or the flag last on the line?).\n    fix: pass a value (e.g. --repo VALUE; "
                                              "quote a variable: --repo \"$VAR\"), or leave --repo out.\n"), r.stdout + r.stderr


def test_compare_refuses_an_empty_profile_entry_and_recommend_names_the_gpu_it_read(invoke_here):
    """Hostile round s11 F6/F7: `compare --profiles a,,b` dropped the empty entry (exit 0; `rollout --steps 5,,100` and
    `nightly --profiles a,,b` refuse it: compare parses --profiles with nightly.select_profiles now); `recommend --gpu
    a100` planned for a100-80gb without saying so (check says it for a profile's target.gpu)."""
    r = invoke_here("compare", "--profiles", "fp8-h100,,bf16-h100", "--out", "/nonexistent-dir/cmp")
    assert r.returncode == 2 and (r.stdout + r.stderr) == (REFUSED + "  --profiles: 'fp8-h100,,bf16-h100' has an empty entry.\n"
                                              "    fix: pass e.g. --profiles fp8-h100,bf16-h100 or all.\n"), (r.stdout + r.stderr)
    r = invoke_here("recommend", "--gpu", "a100")
    assert (r.stdout + r.stderr).splitlines()[0] == ("note: --gpu 'a100' is read as a100-80gb (80 GB, 2,039 GB/s); it also names "
                                        "a100-40gb (40 GB, 1,555 GB/s), for which memory plans and KV capacity differ.")
    r = invoke_here("recommend", "--gpu", "a100-80gb")
    assert (r.stdout + r.stderr).startswith("workload: "), (r.stdout + r.stderr)


def test_profiles_model_without_gpu_is_refused(invoke_here):
    """Hostile s12 F-D: `profiles --model /nonexistent` (no --gpu) exited 0 listing the shipped profiles, --model
    ignored. --model is read only with --gpu: without it, exit 2 naming the flag; with it, a missing folder is refused."""
    r = invoke_here("profiles", "--model", "/nonexistent")
    assert r.returncode == 2 and ("  --model: is read only with --gpu (which profiles run on that GPU for this model).\n"
                                  "    fix: add --gpu (e.g. --gpu h100), or leave --model out to list the shipped "
                                  "profiles.") in (r.stdout + r.stderr), (r.stdout + r.stderr)
    r = invoke_here("profiles", "--gpu", "h100", "--model", "/nonexistent")
    assert r.returncode == 2 and "--model" in (r.stdout + r.stderr), (r.stdout + r.stderr)
    assert invoke_here("profiles").returncode == 0


def test_refusals_go_to_stderr_so_a_redirected_render_gets_only_its_output(invoke_here):
    """Hostile s12 F-J: `build --on k8s > job.yaml` of a refused output exited 2 with nothing on the terminal (the
    refusal was in job.yaml); `check --profile nonexistent 2>/dev/null` still showed the error. Every refusal and
    error now goes to stderr; stdout holds only what the task produces."""
    r = invoke_here("check", "--profile", "nonexistent")
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.startswith("error: the input was refused; nothing was changed.\n  --profile: "), r.stderr


def test_out_inside_a_serving_repository_or_with_an_overlong_name_is_refused_saying_why(tmp_path):
    """Hostile s15 F11: ``build --out <serving repo>/junk`` was accepted (a whole build inside a live model repository,
    listed as a model). s15b F4: a 300-byte folder name said only "cannot be used (OSError)"."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.core.outputs import validate_out_dir

    repo = tmp_path / "srv" / "model_repository"
    (repo / "ensemble").mkdir(parents=True)
    (tmp_path / "srv" / "releases.json").write_text("{}")
    for out in (repo / "junk", repo / "a" / "b", tmp_path / "srv"):
        with pytest.raises(UserError, match="a serving repository") as ei:
            validate_out_dir(out)
        assert ei.value.problems[0].field == "--out"
    assert not (repo / "junk").exists()
    with pytest.raises(UserError) as ei:
        validate_out_dir(tmp_path / ("a" * 300))
    assert "(a folder name of 300 bytes; names are at most 255)" in ei.value.problems[0].reason
    assert validate_out_dir(tmp_path / "fine") == (tmp_path / "fine").resolve()


def test_a_damaged_output_marker_beside_stage_records_is_named_and_rewritable(tmp_path):
    """Hostile s15b F5: ``.precision-build.json`` holding 'nonsense' was reported as missing, with the fix ``rm -r``
    of the whole output (stage records intact). It is named as damaged, with the marker to write back."""
    import json as _json

    from precision_pipeline.core.errors import UserError
    from precision_pipeline.core.outputs import OUTPUT_MARKER, read_output_marker, validate_out_dir

    out = tmp_path / "d1"
    (out / ".stages").mkdir(parents=True)
    (out / "manifest.json").write_text(_json.dumps({"profile": "fp8-h100", "stages": {}}))
    (out / OUTPUT_MARKER).write_text("nonsense\n")
    with pytest.raises(UserError) as ei:
        validate_out_dir(out, ("checkpoint",))
    p = ei.value.problems[0]
    assert p.reason == f"{out / OUTPUT_MARKER} is damaged (not the JSON object a build writes) beside a build's stage records."
    assert "rm -r" not in p.fix
    cmd = p.fix.split("`")[1]
    subprocess.run(["bash", "-c", cmd], check=True)              # the printed repair works
    assert read_output_marker(out) is not None and validate_out_dir(out, ("checkpoint",)) == out.resolve()


def test_out_inside_the_model_or_checkpoint_folder_is_refused(tmp_path, invoke_here, default_model_dir):
    """Hostile s16 H6: ``build --out <model folder>/x`` was accepted; its 210 MB of stage files changed the model's
    content fingerprint, so every gated build of the model became unpromotable and rebuilds missed the per-model bar."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.core.outputs import refuse_out_inside_inputs

    model = Path(default_model_dir).resolve()
    r = invoke_here("build", "--profile", "fp8-h100", "--out", str(model / "x"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert (f"--out: {model / 'x'} is inside the --model folder {model}: the build's files would become part of that "
            "input") in r.stderr and "nothing was written" in r.stderr and not (model / "x").exists()
    ck = tmp_path / "ck"
    ck.mkdir()
    with pytest.raises(UserError, match=f"{ck} is the --checkpoint folder {ck}"):
        refuse_out_inside_inputs(ck, {"--model": model, "--checkpoint": ck})
    refuse_out_inside_inputs(tmp_path / "out", {"--model": model, "--checkpoint": ck, "--other": None})


def test_probe_gate_of_another_build_is_refused(tmp_path):
    """Hostile s16 H12: `probe --gate <another build>/gate` judged the live unit with that build's reference and bar and
    recorded a false FAIL. The gate's build names its unit (its model_repository beside gate/): only that unit is
    judged; none of the probed units being it is refused."""
    from precision_pipeline.cli.serving import _units_of_gate
    from precision_pipeline.core.errors import UserError

    a, b = "tensorrt_llm_aaaaaaaaaaaa", "tensorrt_llm_bbbbbbbbbbbb"
    (tmp_path / "out" / "gate").mkdir(parents=True)
    (tmp_path / "out" / "model_repository" / a).mkdir(parents=True)
    gate = tmp_path / "out" / "gate"
    with pytest.raises(UserError) as ei:
        _units_of_gate(gate, {b: "stable"})
    assert ei.value.problems[0].field == "--gate" and ei.value.problems[0].reason.startswith(
        f"{gate} is the gate of the build in {tmp_path / 'out'} (unit {a}), not of {b}, which the probe asks")
    assert _units_of_gate(gate, {a: "stable", b: "fallback"}) == {a: "stable"}
    (tmp_path / "loose").mkdir()
    assert _units_of_gate(tmp_path / "loose", {b: "stable"}) == {b: "stable"}


def test_probe_without_profile_judges_only_units_the_recorded_profiles_build_packed(tmp_path):
    """Hostile s16b T5: a release promoted with `--profile /path/fp8-h100.yaml` records the name fp8-h100; a probe
    without --profile took the build at artifacts/fp8-h100 (another build) and judged the live unit with its reference
    and bar. A build that did not pack the current unit is refused, naming the recorded profile."""
    from precision_pipeline.cli.serving import _units_of_recorded_build
    from precision_pipeline.core.errors import UserError

    a, b = "tensorrt_llm_aaaaaaaaaaaa", "tensorrt_llm_bbbbbbbbbbbb"
    packed = tmp_path / "out" / "model_repository"
    (packed / a).mkdir(parents=True)
    with pytest.raises(UserError) as ei:
        _units_of_recorded_build(packed, {b: "stable"}, "fp8-h100", {"current": b})
    p = ei.value.problems[0]
    assert p.field == "--profile" and p.reason == (
        f"not given, so the current release's recorded profile fp8-h100 was taken; its build in {tmp_path / 'out'} "
        f"packed {a}, not the current release {b}: the probe would judge it against another build's reference outputs "
        "and bar, and record the verdict; nothing was probed.")
    # the build of the current unit: every route's unit is judged (the fallback held to the primary's bar)
    assert _units_of_recorded_build(packed, {a: "stable", b: "fallback"}, "fp8-h100", {"current": a}) == {a: "stable", b: "fallback"}


def test_a_repeated_probe_stops_when_the_routes_no_longer_reach_its_units(tmp_path, monkeypatch):
    """Hostile s16b T72: `probe --every` kept probing the unit a promote had made old (then unloaded), recording a
    FAIL each run against the old build's bar. Before each repeated run the routes are read again; when they reach
    other units the probe says so and stops (the runs so far judged, nothing more)."""
    import io

    from rich.console import Console

    from precision_pipeline.cli.serving import _probe_runs
    from precision_pipeline.serving import probe as pr

    a, b = "tensorrt_llm_aaaaaaaaaaaa", "tensorrt_llm_bbbbbbbbbbbb"
    routes = [{a: "all"}, {a: "all"}, {b: "all"}]
    monkeypatch.setattr(pr, "route_units", lambda repo: routes.pop(0))
    monkeypatch.setattr("time.sleep", lambda s: None)
    probed = []
    buf = io.StringIO()
    con = Console(file=buf, width=400)
    assert _probe_runs(con, lambda u, r: probed.append(u) or {"passed": True}, {a: "all"}, 5.0, None, tmp_path) is False
    assert probed == [a, a] and routes == []  # the start's routes, then one read after each of the two runs
    assert f"stopped: the repository's routes now reach {b}, not {a} (a promote, rollback or rollout moved" in buf.getvalue()
    # a unit no route reached at the start (a --profile build's, not current) is not watched: the runs end at --runs
    routes[:] = [{b: "all"}] * 5
    probed.clear()
    assert _probe_runs(con, lambda u, r: probed.append(u) or {"passed": True}, {a: ""}, 5.0, 3, tmp_path) is False
    assert probed == [a] * 3
    # without a repository to watch (--unit), the runs end at --runs
    probed.clear()
    assert _probe_runs(con, lambda u, r: probed.append(u) or {"passed": False}, {a: ""}, 5.0, 4, None) is True
    assert probed == [a] * 4


def test_relative_paths_are_the_callers_not_the_checkouts(tmp_path, monkeypatch):
    """Hostile s17 F10: run.sh changes into the checkout, so `cd /data && run.sh promote --repo serving/repo` wrote
    into <checkout>/serving/repo, `rollback --repo ../x` looked beside the checkout and `check --profile ./p.yaml`
    found no file. Relative path flags and a profile given as a path are the caller's; a bare profile name stays a
    shipped profile; nothing changes when called from the checkout."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tasks_under_test", ROOT / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    seen = {}

    @tasks.guarded
    def job(c=None, **kw):
        seen.update(kw)

    monkeypatch.setenv(tasks.CALLER_CWD_ENV, str(tmp_path))
    job(None, repo="serving/repo", out="../o", profile="./p.yaml", model="/abs/m", gate="~/g")
    assert seen == {"repo": str(tmp_path / "serving/repo"), "out": str(tmp_path / "../o"),
                    "profile": os.path.join(tmp_path, "./p.yaml"), "model": "/abs/m", "gate": "~/g"}
    job(None, profile="fp8-h100", repo="r")
    assert seen["profile"] == "fp8-h100" and seen["repo"] == str(tmp_path / "r")
    monkeypatch.setenv(tasks.CALLER_CWD_ENV, str(ROOT))
    job(None, profile="precision_profiles/fp8-h100.yaml", repo="r")
    assert seen == {**seen, "profile": "precision_profiles/fp8-h100.yaml", "repo": "r"}


def test_run_sh_from_another_folder_reads_relative_paths_there(tmp_path):
    """The same through the real command line: `releases --repo rel` from another folder names that folder's path."""
    r = subprocess.run([str(ROOT / "run.sh"), "releases", "--repo", "no/such/repo"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PRECISION_CALLER_CWD": ""})
    assert r.returncode == 2 and str(tmp_path / "no/such/repo") in r.stdout + r.stderr, r.stdout + r.stderr


def test_an_interrupt_during_the_entry_point_check_says_the_change_took_effect(monkeypatch):
    """Hostile s17 F16: SIGTERM/Ctrl-C of promote or rollback --url while its request through the BLS ran (after the
    commit) said "interrupted; previous artifacts are intact", exit 130, although the change had taken effect."""
    from precision_pipeline.cli import serving as cli
    from precision_pipeline.core.errors import EXIT_INTERRUPTED, InterruptedAfterCommit, exit_code_for

    def interrupted(server, repo, done):
        raise KeyboardInterrupt

    monkeypatch.setattr("precision_pipeline.serving.serve_watchdog.entry_point_note", interrupted)
    with pytest.raises(InterruptedAfterCommit) as ei:
        cli._entry_point(object(), Path("repo"), "rolled back to tensorrt_llm_aaaaaaaaaaaa")
    assert str(ei.value).startswith("rolled back to tensorrt_llm_aaaaaaaaaaaa, interrupted after the switch, while a "
                                    "request checked the entry point: the change took effect")
    assert exit_code_for(ei.value) == EXIT_INTERRUPTED == 130


def test_a_probe_whose_release_moved_while_it_waited_for_the_lock_probes_nothing(tmp_path, monkeypatch):
    """Hostile s17 F15: a probe started while a rollback held the lock read the current release (and its profile)
    before, its units after: the new unit was judged with the old build's reference and bar, a FAIL recorded."""
    from precision_pipeline.cli import serving as cli
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.serving import release, release_recover

    a, b = "tensorrt_llm_aaaaaaaaaaaa", "tensorrt_llm_bbbbbbbbbbbb"
    monkeypatch.setattr(release_recover, "recover", lambda repo, server: [])
    monkeypatch.setattr(release, "read_state", lambda repo: {"current": b})
    (tmp_path / "repo").mkdir()
    with pytest.raises(UserError) as ei:
        cli._recover_for_probe(tmp_path / "repo", None, {"current": a})
    assert ei.value.problems[0].reason.startswith(f"the current release changed from {a} to {b} while this probe started")
    assert cli._recover_for_probe(tmp_path / "repo", None, {"current": b}) == []


def test_promote_out_a_file_and_probe_url_empty_say_what_is_wrong(tmp_path):
    """Hostile s17 F18: `promote --out <a file>` said "holds no finished build" and prescribed a build into that file;
    `probe --url ''` was refused after 20 s with promote's fix ("leave --url out to only rewrite the repository")."""
    from precision_pipeline.cli import serving as cli
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.serving import build_output

    f = tmp_path / "releases.json"
    f.write_text("{}")
    with pytest.raises(UserError) as ei:
        build_output.open_build("fp8-h100", f)
    assert ei.value.problems[0].reason == f"{f} is a file, not a build output folder."
    with pytest.raises(UserError) as ei:
        cli.probe(url="  ", repo=str(tmp_path / "none"))
    assert ei.value.problems[0].field == "--url" and ei.value.problems[0].fix.endswith("leave --url out for 127.0.0.1:8000.")


def test_serve_of_a_profile_and_a_repo_is_refused_and_an_unbuilt_profile_names_a_fix_serve_has(tmp_path, monkeypatch):
    """Hostile s17 F18: `serve --profile P --repo R` served R and ignored P; `serve --profile <unbuilt>` offered
    `--out`, which serve does not have."""
    from precision_pipeline.cli import serving as cli
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.serving import build_output

    with pytest.raises(UserError) as ei:
        cli.serve(profile="fp8-h100", repo=str(tmp_path))
    assert ei.value.problems[0].reason.startswith("and --repo name two things to serve")

    def unbuilt(ref, out=None):
        raise build_output.NotBuilt("--profile", "x holds no finished build of fp8-h100 (.stages/pack.json is missing).",
                                    "run it, or pass --out with the folder of its build.")
    monkeypatch.setattr(build_output, "open_build", unbuilt)
    with pytest.raises(UserError) as ei:
        cli.serve(profile="fp8-h100")
    assert "--out" not in ei.value.problems[0].fix and ei.value.problems[0].fix.startswith("build it first")


def test_a_model_folder_given_as_repo_names_the_repository(tmp_path):
    """Hostile s17b F13: `rollback --repo R/ensemble` was answered with `invoke serve --repo R/ensemble` as the fix."""
    from precision_pipeline.cli.serving import serving_repo
    from precision_pipeline.core.errors import UserError

    (tmp_path / "repo" / "ensemble").mkdir(parents=True)
    (tmp_path / "releases.json").write_text("{}")
    with pytest.raises(UserError) as ei:
        serving_repo(str(tmp_path / "repo" / "ensemble"))
    assert ei.value.problems[0].fix == f"pass --repo {tmp_path / 'repo'}."
    assert serving_repo(str(tmp_path / "repo")) == tmp_path / "repo"
    # hostile s17c F2: promote created a new repository (and its releases.json) inside r2/repo/ensemble/newrepo
    with pytest.raises(UserError) as ei:
        serving_repo(str(tmp_path / "repo" / "ensemble" / "newrepo"))
    assert ei.value.problems[0].reason == (f"{tmp_path / 'repo' / 'ensemble' / 'newrepo'} is inside the serving repository "
                                           f"{tmp_path / 'repo'} (a new repository there would be created inside one of "
                                           "its model folders).")
    assert serving_repo(str(tmp_path / "newrepo")) == tmp_path / "newrepo"
    with pytest.raises(UserError) as ei:  # hostile s18b F6: one folder too high ("no releases.json beside it")
        serving_repo(str(tmp_path))
    assert ei.value.problems[0].fix == f"pass --repo {tmp_path / 'repo'}."


def test_a_port_that_is_no_number_suggests_the_default_port():
    """Hostile s17c note: `serve --http-port abc` suggested `--http-port 1`."""
    from precision_pipeline.cli import serving as cli
    from precision_pipeline.core.errors import UserError

    for flag, kw, port in (("--http-port", "http_port", 8000), ("--grpc-port", "grpc_port", 8001),
                           ("--metrics-port", "metrics_port", 8002)):
        with pytest.raises(UserError) as ei:
            cli.serve(repo="/nonexistent-repo", **{kw: "abc"})
        assert ei.value.problems[0].field == flag and ei.value.problems[0].fix == f"pass e.g. {flag} {port}."
