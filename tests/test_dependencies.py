"""The architecture, by test: dependencies one way (quant → nothing of ours; engine → quant; only
bonsai_cli reads YAML), no import cycles (function-level imports counted: they are for the CLI's
start-up time, never a way around a cycle), only `bonsai serve` imports the server, small files, and
logits become tokens in the sampler, the verifier and the drafters' proposals only."""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "quant", "bonsai_cli")
FORBIDDEN = {"quant": {"engine", "bonsai_cli"}, "engine": {"bonsai_cli"}}
MAX_LINES = 400
# where a tensor of logits may become tokens (argmax, multinomial, top-k); everywhere else calls these
CHOOSING = {
    "engine/decoding/sampling.py": "the sampler: greedy, filtered sampling, logprobs",
    "engine/speculative/verify.py": "verification: which drafts the target keeps, and its bonus token",
    "engine/speculative/draft_model.py": "a draft model's proposal",
    "engine/speculative/hidden_drafter.py": "the MTP / DFlash drafters' proposal (TokenPicker)",
    "engine/speculative/drafter_data.py": "the target's top-k distribution recorded as training data",
    "engine/speculative/drafter_train.py": "the training loss's top-1 agreement figure",
    "engine/quantization/evaluate.py": "bonsai eval's same-top-token rate (scores a text, decodes nothing)",
}
CHOICE_CALLS = {"argmax", "multinomial", "topk"}


def sources(packages=PACKAGES):
    for package in packages:
        yield from sorted((ROOT / package).rglob("*.py"))


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def imported_top_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """Our modules `path` imports anywhere in it (module level or inside a function)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def choice_calls(text: str) -> list[int]:
    """Lines of code (not strings, not comments) calling argmax / multinomial / topk."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
              if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)]
    return [a.start[0] for a, b in zip(tokens, tokens[1:])
            if a.type == tokenize.NAME and a.string in CHOICE_CALLS and b.string == "("]


def test_one_way_dependencies():
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in (ROOT / package).rglob("*.py"):
            hits = imported_top_modules(path) & forbidden
            if hits:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(hits)}")
    assert not bad, bad


def test_only_the_cli_reads_yaml():
    bad = [str(p.relative_to(ROOT)) for package in ("engine", "quant") for p in (ROOT / package).rglob("*.py")
           if "yaml" in imported_top_modules(p)]
    assert not bad, bad


def test_the_rule_catches_a_planted_violation(tmp_path):
    planted = tmp_path / "bad.py"
    planted.write_text("from engine.runtime.model import Transformer\nimport bonsai_cli.main\n")
    assert {"engine", "bonsai_cli"} <= imported_top_modules(planted)


def test_no_import_cycles_even_through_function_level_imports():
    paths = {module_name(p): p for p in sources()}
    known = set(paths)
    graph = {name: imported_modules(path, known) - {name} for name, path in paths.items()}
    assert import_cycles(graph) == []
    # a cycle hidden in a function is still a cycle
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph["engine.errors"] = graph["engine.errors"] | {"engine.runtime.runner"}  # planted
    assert any("engine.errors" in c for c in import_cycles(graph))


def test_only_bonsai_serve_imports_the_server():
    bad = [str(p.relative_to(ROOT)) for p in sources() if not str(p.relative_to(ROOT)).startswith("engine/server/")
           and any(m == "engine.server" or m.startswith("engine.server.")
                   for m in imported_modules(p, {module_name(q) for q in sources()} | {"engine.server"}))]
    assert bad == ["bonsai_cli/cmd_serve.py"], bad


def test_files_stay_small():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in sources()
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, long


def test_logits_become_tokens_in_the_sampler_the_verifier_and_the_drafters_only():
    bad = [f"{p.relative_to(ROOT)}:{lines[0]}" for p in sources(("engine", "bonsai_cli"))
           if str(p.relative_to(ROOT)) not in CHOOSING and (lines := choice_calls(p.read_text()))]
    assert not bad, f"tokens chosen outside {sorted(CHOOSING)}: {bad} (call engine.decoding.sampling)"
    planted = 'def pick(logits):\n    """argmax( in a docstring is prose"""\n    return int(logits.argmax())  # argmax(\n'
    assert choice_calls(planted) == [3]


def test_both_runners_have_the_runner_interface():
    import inspect

    from engine.pipeline.runner import PipelineRunner
    from engine.runtime.runner import ModelRunner, Runner
    methods = [n for n, v in vars(Runner).items() if callable(v) and not n.startswith("_")]
    assert {"forward", "prefill", "decode_batch", "verify", "step_rows", "prepare_rows", "close"} <= set(methods)
    for cls in (ModelRunner, PipelineRunner):
        for name in methods:
            want = list(inspect.signature(getattr(Runner, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls.__name__, name)
