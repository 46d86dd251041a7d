"""Every option defined once (shared/options.py and the three */config.py), walked field by field:
its flag on its own command and on `serve`, its TS_* variable, `--help`, `--config` and
`--print-config`, errors at the door, and the README's table."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from shared.common_config import ModelRef
from shared.option_kinds import (Address, Choice, FilePath, Flag, Integer, Number, Port, Repeated, Size, Text,
                                 parse_size)
from shared.served_models import ModelEntry, SchedulerGroup
from tensorserve.gpus import GpuList
from shared.options import ConfigError, Option, options_of, resolve
from tensorserve import cli, options_table
from tensorserve.serve import OPTIONS as SERVE_OPTIONS
from tensorserve.serve import ServeOptions
from worker.config import WorkerConfig

REPO = Path(__file__).resolve().parents[1]
PROCESSES = {"router": RouterConfig, "scheduler": SchedulerConfig, "worker": WorkerConfig}
ALL = [(name, opt) for name, cls in PROCESSES.items() for opt in options_of(cls)]


def _id(item):
    return f"{item[0]}.{item[1].name}"


def sample(opt: Option, tmp: Path) -> str:
    """A valid value of the option, other than its default, as a user would type it."""
    kind = opt.kind
    if isinstance(kind, Repeated):      # one element, as one flag or variable gives
        return {ModelEntry: "gemma3-270m", SchedulerGroup: "127.0.0.1:4321"}[type(kind.inner)]
    if isinstance(kind, ModelRef):
        return "gemma3-270m" if opt.default != "gemma3-270m" else "smollm2-135m"
    if isinstance(kind, Flag):
        return "false" if opt.default else "true"
    if isinstance(kind, Choice):
        return next(v for v in kind.values if v != opt.default)
    if isinstance(kind, Size):
        return "3MiB"
    if isinstance(kind, Port):
        return "12345"
    if isinstance(kind, Integer):
        low = kind.minimum if kind.minimum is not None else 0
        return str(max(low, (opt.default or low)) + 1)
    if isinstance(kind, Number):
        if kind.maximum is not None:            # a fraction (--gpu-memory-utilization)
            return str(((opt.default or 0) + kind.maximum) / 2)
        return str((opt.default or 0) + 1.5)
    if isinstance(kind, GpuList):
        return "0,1"
    if isinstance(kind, Address):
        return "127.0.0.1:4321"
    if isinstance(kind, FilePath):
        path = tmp / f"{opt.name}.txt"
        path.write_text("{{ messages }}")
        return str(path)
    assert isinstance(kind, Text), f"no sample for {type(kind).__name__}"
    return f"value-of-{opt.name}"


def _help(command: str) -> str:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return " ".join(sub.choices[command].format_help().split())


@pytest.mark.parametrize("item", ALL, ids=_id)
def test_flag_on_its_command_and_serve_with_variable_and_default_in_help(item):
    process, opt = item
    text = _help(process)
    for flag in opt.flags:
        assert flag in text, f"{flag} missing from `tensorserve {process} --help`"
    assert f"env {opt.env[0]}," in text and "default" in text
    serve_flags = {f for o in SERVE_OPTIONS for f in o.flags}
    if opt.spec.internal:
        assert opt.name not in {o.name for o in SERVE_OPTIONS if o.spec is opt.spec}
    else:
        assert opt.flag in serve_flags and opt.flag in _help("serve"), f"{opt.flag} missing from serve"


@pytest.mark.parametrize("item", ALL, ids=_id)
def test_variable_takes_effect_and_the_flag_wins(item, tmp_path):
    _, opt = item
    value = sample(opt, tmp_path)
    from_env = resolve([opt], {}, environ={opt.env[0]: value})
    assert from_env.values[opt.name] == opt.kind.parse(value) != opt.default
    assert from_env.source(opt.name) == f"environment variable {opt.env[0]}"
    assert resolve([opt], {}, environ={opt.env[0]: ""}).values[opt.name] == opt.default    # empty = unset
    flag_value = True if isinstance(opt.kind, Flag) and value == "false" else (
        False if isinstance(opt.kind, Flag) else value)
    both = resolve([opt], {opt.name: flag_value}, environ={opt.env[0]: value})
    assert both.source(opt.name) == f"flag {opt.flag}"


def test_each_option_has_one_name_across_the_product():
    """A field two processes need is one definition (the same flag, variable and default), and no
    two different options share a variable."""
    by_env: dict[str, set[int]] = {}
    for _, opt in ALL + [("serve", o) for o in options_of(ServeOptions)]:
        by_env.setdefault(opt.env[0], set()).add(id(opt.spec))
    shared = {e: ids for e, ids in by_env.items() if len(ids) > 1}
    # TS_READY_FILE: the router's ready file and serve's are the same file for a user: serve's own;
    # TS_MODEL / --model: the router's models (repeatable) and a worker's one model, which serve
    # hands each worker (serve takes the router's)
    assert set(shared) <= {"TS_READY_FILE", "TS_MODEL"}, shared
    model = [o for _, o in ALL if o.flag == "--model"]
    assert sorted(o.name for o in model) == ["model", "models"]
    assert [o.name for o in SERVE_OPTIONS if o.flag == "--model"] == ["models"]


@pytest.mark.parametrize("process", [*PROCESSES, "serve"])
def test_every_variable_reaches_the_process_and_print_config_round_trips(process, tmp_path):
    """The command itself (a subprocess) reads every variable; its --print-config reads back
    through --config to the same configuration."""
    options = SERVE_OPTIONS if process == "serve" else options_of(PROCESSES[process])
    env = {k: v for k, v in os.environ.items() if not k.startswith("TS_")}
    values = {o.env[0]: sample(o, tmp_path) for o in options}
    run = lambda *args, extra=None: subprocess.run(   # noqa: E731
        [sys.executable, "-m", "tensorserve", process, *args], env={**env, **(extra or {})},
        capture_output=True, text=True, timeout=120, cwd=REPO)
    out = run("--print-config", extra=values)
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert list(printed) == [o.name for o in options]
    for o in options:
        if o.spec.secret:
            assert printed[o.name] == "***" and values[o.env[0]] not in out.stdout
        else:
            assert o.kind.from_yaml(printed[o.name]) == o.kind.parse(values[o.env[0]]), o.name
    path = tmp_path / "config.yaml"
    path.write_text(out.stdout)
    secrets = {o.env[0]: values[o.env[0]] for o in options if o.spec.secret}
    again = run("--config", str(path), "--print-config", extra=secrets)
    assert again.returncode == 0, again.stderr
    assert again.stdout == out.stdout


def test_precedence_flag_over_environment_over_file_over_default(tmp_path):
    options = options_of(SchedulerConfig)
    path = tmp_path / "c.yaml"
    path.write_text("max_num_seqs: 7\nmax_num_batched_tokens: 100\nnum-decode-steps: 3\n")
    aliased = tmp_path / "vllm.yaml"
    aliased.write_text("max_model_len: 2048\n")      # vLLM's names work as keys too
    assert resolve(options_of(WorkerConfig), {}, environ={}, config_file=str(aliased)).values["max_context"] == 2048
    r = resolve(options, {"max_num_seqs": "5"}, environ={"TS_MAX_NUM_SEQS": "6", "TS_MAX_NUM_BATCHED_TOKENS": "99"},
                config_file=str(path))
    assert (r.values["max_num_seqs"], r.values["max_num_batched_tokens"], r.values["num_decode_steps"],
            r.values["max_prefill_tokens_while_decoding"]) == (5, 99, 3, 48)
    assert r.source("num_decode_steps") == f"config file {path}, key num_decode_steps"
    assert r.source("max_prefill_tokens_while_decoding") == "default"
    assert any(line.startswith("max_num_seqs=5 (flag --max-num-seqs)") for line in r.non_default())


@pytest.mark.parametrize("args, env, where, accepted", [
    (["--http-port", "70000"], {}, "flag --http-port: 70000 is out of range", "0..65535"),
    (["--port", "-1"], {}, "flag --http-port: -1 is out of range", "0..65535"),     # vLLM's alias
    ([], {"TS_KV_MEMORY": "lots"}, "environment variable TS_KV_MEMORY: 'lots' is not a size", "MiB"),
    (["--kv-memory=-5MiB"], {}, "flag --kv-memory: '-5MiB' is not a size", "positive size"),
    (["--kv-memory"], {}, "argument --kv-memory: expected one argument", "tensorserve serve --help"),
    (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag", "--help"),
    (["--max-num-seqs", "zero"], {}, "flag --max-num-seqs: 'zero' is not an integer", ">= 1"),
    (["--tensor-transport", "rdma"], {}, "flag --tensor-transport: 'rdma' is not a choice", "auto, shm, inline"),
    (["--log-level", "loud"], {}, "flag --log-level: 'loud' is not a choice", "debug, info"),
    ([], {"TS_GRACE_PERIOD": "nan"}, "environment variable TS_GRACE_PERIOD: 'nan' is not a finite number", ">= 0"),
    ([], {"TS_ENABLE_PREFIX_CACHING": "maybe"}, "TS_ENABLE_PREFIX_CACHING: 'maybe' is not a boolean", "true or false"),
    (["--model", "no-such-model"], {}, "flag --model: 'no-such-model' is neither", "bundled model"),
    (["--chat-template", "/no/such/file.jinja"], {}, "flag --chat-template: '/no/such/file.jinja' is not", "file"),
    (["--max-model-len", "100000"], {}, "--max-context 100000 (flag): exceeds the trained context", "8192"),
    (["--max-context", "8192", "--kv-memory", "16MiB"], {}, "--max-context 8192 (flag): --kv-memory 16MiB (flag) "
     "holds 720 tokens", "raise --kv-memory"),
])
def test_serve_refuses_bad_values_at_the_door(args, env, where, accepted):
    """Status 2 and one line naming the source, the value and what is accepted, before any child starts."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TS_")}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "tensorserve", "serve", "--log-level", "info", *args],
                         env={**clean, **env}, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert where in lines[0] and accepted in lines[0]
    assert "starting worker" not in out.stderr and time.monotonic() - t0 < 60


def test_a_config_file_with_an_unknown_key_or_bad_yaml_is_refused(tmp_path):
    options = options_of(WorkerConfig)
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text("kv_memry: 1GiB\n")
    with pytest.raises(ConfigError, match="unknown key 'kv_memry'"):
        resolve(options, {}, environ={}, config_file=str(bad_key))
    bad_yaml = tmp_path / "b.yaml"
    bad_yaml.write_text("kv_memory: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        resolve(options, {}, environ={}, config_file=str(bad_yaml))
    wrong_type = tmp_path / "c.yaml"
    wrong_type.write_text("block_size: true\n")
    with pytest.raises(ConfigError, match=r"config file .*c.yaml, key block_size: True is not an integer"):
        resolve(options, {}, environ={}, config_file=str(wrong_type))


def test_sizes_parse_and_print_back():
    assert [parse_size(s) for s in ("512MiB", "2GiB", "1.5G", "100MB", "67108864")] == \
        [512 * 2**20, 2 * 2**30, int(1.5 * 2**30), 10**8, 67108864]
    assert Size().format(512 * 2**20) == "512MiB" and Size().format(1000) == "1000"


def test_version():
    out = subprocess.run([sys.executable, "-m", "tensorserve", "--version"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0 and out.stdout.startswith("tensorserve ") and out.stdout.split()[1][0].isdigit()


def test_threads_sets_the_compute_threads_before_the_kernels_load():
    code = ("import sys; from tensorserve import cli; from shared.common_config import configure;"
            "from worker.config import WorkerConfig;"
            "p = cli.build_parser(); a = p.parse_args(['worker', '--threads', '1']);"
            "configure('worker', WorkerConfig, a);"
            "import os, numba;"
            "print(numba.get_num_threads(), [os.environ[v] for v in ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS')])")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TS_", "NUMBA_", "OPENBLAS_NUM", "OMP_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    numba_threads, blas = out.stdout.split(maxsplit=1)
    assert numba_threads == "1" and ast.literal_eval(blas) == ["1", "1"]


def test_chat_template_file_overrides_the_gguf(tmp_path):
    """Gemma 3 270M base has no chat template: with --chat-template it serves chat prompts."""
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    out = subprocess.run([sys.executable, "-m", "tensorserve", "generate", "--model", "gemma3-270m", "--chat",
                          "--chat-template", str(template), "--prompt", "Hi", "--max-tokens", "2"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    out = subprocess.run([sys.executable, "-m", "tensorserve", "router", "--chat-template", str(broken)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2 and "--chat-template" in out.stderr and "does not parse" in out.stderr


def test_readme_options_table_is_the_generated_one():
    readme = (REPO / "README.md").read_text()
    assert options_table.readme_with_table(readme) == readme, \
        "README's options table is stale: run `python -m tensorserve.options_table`"
    for opt in {o.spec: o for _, o in ALL}.values():
        assert f"`{opt.env[0]}`" in readme


def test_product_variables_are_read_in_one_module():
    """TS_* options are read by shared/options.py alone, kernel switches by kernels/switches.py."""
    readers = []
    for package in ("router", "scheduler", "worker", "shared", "tensorserve", "kernels", "protos"):
        for path in (REPO / package).rglob("*.py"):
            text = path.read_text()
            if "environ.get(" in text or "getenv(" in text or "environ[\"TS_" in text:
                readers.append(str(path.relative_to(REPO)))
    assert sorted(readers) == ["kernels/switches.py", "shared/options.py"], readers
