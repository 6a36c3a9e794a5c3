"""Static checks of the code's structure (ast only: nothing here imports torch or the toolkit).

* The import graph of `toolkit.*` and train_curriculum.py has no cycle. Module-level imports are the graph;
  function-local (lazy) imports are listed separately, and one that would close a cycle must say why in a comment
  on its line or the line above.
* Strategy specifics live in toolkit/strategies/ only. Outside it, no module may
  - import from `deepspeed`, `torch.distributed.fsdp`, `torch.distributed.tensor` / `_tensor`,
    `transformers.integrations.deepspeed`, `accelerate.utils.deepspeed` / `fsdp_utils`, or import or name
    `DTensor`, `FSDPModule`, `fully_shard`, `DeepSpeedPlugin`, `FullyShardedDataParallelPlugin`, `HfDeepSpeedConfig`;
  - reference `DistributedType.DEEPSPEED` / `DistributedType.FSDP`, or compare with the strings "DEEPSPEED" / "FSDP";
  - touch a DeepSpeed engine / ZeRO / DTensor attribute (`STRATEGY_ATTRS`), as an attribute or as a string
    (getattr / hasattr / a dict key).
* The packages are layered (`LAYERS`, bottom first; docs/architecture.md draws them): a module imports only
  modules of its own package or of packages below it, at module level or lazily; `if TYPE_CHECKING:` imports
  (annotations only) are not imports. The toolkit's top level holds the leaves only.
* A run's folder layout is spelled in toolkit/runtime/run_dir.py only (`RunLayout`): no other module of the toolkit or
  train_curriculum.py holds the name of one of its entries (`RUN_LAYOUT_NAMES`) as a string.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STRATEGIES_DIR = "toolkit/strategies/"

FORBIDDEN_MODULES = ("deepspeed", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed._tensor",
                     "transformers.integrations.deepspeed", "accelerate.utils.deepspeed",
                     "accelerate.utils.fsdp_utils")
FORBIDDEN_NAMES = {"DTensor", "FSDPModule", "fully_shard", "DeepSpeedPlugin", "FullyShardedDataParallelPlugin",
                   "HfDeepSpeedConfig"}
FORBIDDEN_STRINGS = {"DEEPSPEED", "FSDP"}
STRATEGY_ATTRS = {
    # DeepSpeed ZeRO-3 parameter attributes
    "ds_numel", "ds_id", "ds_tensor", "ds_persist", "ds_shape", "ds_status",
    # accelerate's strategy plugins and the DeepSpeed config
    "deepspeed_plugin", "fsdp_plugin", "deepspeed_config", "zero_optimization", "deepspeed_config_file",
    "_hf_deepspeed_config_weak_ref",
    # DeepSpeed ZeRO optimizer internals
    "fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "bit16_groups_flat",
    "grad_partitions_flat_buffer",
    # DTensor (FSDP2)
    "full_tensor", "to_local", "device_mesh", "placements",
}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported toolkit module (or train_curriculum)
    line: int
    lazy: bool  # inside a function
    commented: bool  # a comment on its line or the line above


def _sources(root: Path) -> dict[str, Path]:
    """Module name -> file, for toolkit/**/*.py and train_curriculum.py under `root`."""
    found = {"train_curriculum": root / "train_curriculum.py"} if (root / "train_curriculum.py").is_file() else {}
    for path in sorted((root / "toolkit").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_of(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every runtime import statement with whether it is function-local (`if TYPE_CHECKING:` blocks skipped)."""
    out: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.append((child, lazy))
            visit(child, lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(tree, False)
    return out


def _imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Full dotted names a statement imports: `from a import b` is `a` and `a.b` (b may be a submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, *([base] if base else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_edges(root: Path) -> list[Import]:
    """Imports between the project's modules (an import of a submodule also runs its parent packages)."""
    modules = _sources(root)
    edges = []
    for name, path in modules.items():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node, lazy in _imports_of(ast.parse(text, str(path))):
            targets: set[str] = set()
            for full in _imported_modules(node, name, path.name == "__init__.py"):
                parts = full.split(".")
                targets |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules.keys()
            here = lines[node.lineno - 1]
            above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            commented = "#" in here or above.startswith("#")
            for target in sorted(targets - {name}):
                if name.startswith(target + "."):
                    continue  # a submodule importing its own package: Python has it initialised first
                edges.append(Import(name, target, node.lineno, lazy, commented))
    return edges


def find_cycles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return components


def strategy_violations(source: str, filename: str = "<src>") -> list[str]:
    """`line: what` for every use of strategy specifics in `source` (see the module docstring)."""
    found: list[str] = []

    for node in ast.walk(ast.parse(source, filename)):
        what = _violation(node)
        if what:
            found.append(f"{filename}:{node.lineno}: {what}")  # type: ignore[attr-defined]
    return found


def _violation(node: ast.AST) -> str | None:
    if isinstance(node, ast.Import | ast.ImportFrom):
        for full in _imported_modules(node, "", False):
            if any(full == m or full.startswith(m + ".") for m in FORBIDDEN_MODULES):
                return f"imports {full}"
        names = {alias.name for alias in node.names} & FORBIDDEN_NAMES
        return f"imports {', '.join(sorted(names))}" if names else None
    if isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
        return f"names {node.id}"
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "DistributedType" and node.attr in FORBIDDEN_STRINGS:
            return f"DistributedType.{node.attr}"
        if node.attr in STRATEGY_ATTRS:
            return f"attribute .{node.attr}"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if node.value in FORBIDDEN_STRINGS:
            return f"string {node.value!r}"
        if node.value in STRATEGY_ATTRS:
            return f"attribute name {node.value!r}"
    return None


RUN_LAYOUT_OWNER = "toolkit/runtime/run_dir.py"
RUN_LAYOUT_NAMES = {"checkpoints", "final", "metrics.jsonl", "run.json", "recipe.yaml", "trackers", "dummy_data",
                    "training.png", ".toolkit-cache", "tokenized", "locks", "earlier-attempts", "logs", "evals",
                    "matrix.jsonl", "forgetting.png", "report.html"}


def layout_literals(source: str, filename: str = "<src>") -> list[str]:
    """`line: name` for every string constant in `source` that is the name of an entry of a run's folder."""
    return [f"{filename}:{node.lineno}: {node.value!r}" for node in ast.walk(ast.parse(source, filename))
            if isinstance(node, ast.Constant) and node.value in RUN_LAYOUT_NAMES]


def _project_files(root: Path) -> dict[str, Path]:
    return {str(path.relative_to(root)): path for path in _sources(root).values()}


LAYERS: tuple[tuple[str, ...], ...] = (
    ("toolkit", "toolkit.errors", "toolkit.atomic", "toolkit.templates"),  # leaves
    ("toolkit.strategies",),
    ("toolkit.builtin",),
    ("toolkit.config",),
    ("toolkit.runtime",),
    ("toolkit.metrics",),
    ("toolkit.data",),
    ("toolkit.checkpoint",),
    ("toolkit.model",),
    ("toolkit.curriculum",),
    ("toolkit.evals",),
    ("toolkit.train",),
    ("toolkit.commands", "toolkit.__main__"),
    ("train_curriculum",),
)
"""The packages bottom first: each imports only its own and those above it in this list."""


def layer_of(module: str) -> int:
    """The index in LAYERS of the package (or leaf module) that holds `module`."""
    for i, members in enumerate(LAYERS):
        if any(module == m or (m != "toolkit" and module.startswith(m + ".")) for m in members):
            return i
    raise AssertionError(f"{module} is in no layer: a new top-level module or package goes into LAYERS (and "
                         "docs/architecture.md)")


def upward_imports(edges: list[Import]) -> list[str]:
    """Imports of a module from a higher layer than the importer's."""
    return [f"{e.source}:{e.line} imports {e.target}" for e in edges if layer_of(e.target) > layer_of(e.source)]


def test_packages_import_only_downward() -> None:
    edges = import_edges(REPO)
    assert upward_imports(edges) == []
    assert {layer_of(m) for m in _sources(REPO)} == set(range(len(LAYERS)))  # every layer holds code
    loose = sorted(m for m in _sources(REPO) if m.count(".") == 1 and layer_of(m) != 0 and m not in
                   {member for layer in LAYERS for member in layer})
    assert loose == [], "a module at the toolkit's top level belongs in a package"
    # the rule can fail: the data layer importing the model, and a leaf importing the config
    assert upward_imports([Import("toolkit.data.packing", "toolkit.model.attention", 1, False, False),
                           Import("toolkit.errors", "toolkit.config.schema", 1, True, True)]) == [
        "toolkit.data.packing:1 imports toolkit.model.attention", "toolkit.errors:1 imports toolkit.config.schema"]


def test_module_level_import_graph_has_no_cycle() -> None:
    edges = import_edges(REPO)
    module_level = [(e.source, e.target) for e in edges if not e.lazy]
    assert len(module_level) > 20, "the scan found too few imports to mean anything"
    assert find_cycles(module_level) == []


def test_lazy_imports_that_close_a_cycle_say_why() -> None:
    edges = import_edges(REPO)
    cycles = find_cycles([(e.source, e.target) for e in edges])
    in_cycle = {m for component in cycles for m in component}
    closing = [e for e in edges if e.lazy and e.source in in_cycle and e.target in in_cycle]
    silent = [f"{e.source}:{e.line} -> {e.target}" for e in closing if not e.commented]
    lazy = sorted(f"{e.source}:{e.line} -> {e.target}" for e in edges if e.lazy)
    assert silent == [], f"lazy imports that hide a cycle need a comment saying why (all lazy imports: {lazy})"


def test_strategy_specifics_only_in_strategies_package() -> None:
    found = []
    files = _project_files(REPO)
    assert any(name.startswith(STRATEGIES_DIR) for name in files)
    for name, path in files.items():
        if not name.startswith(STRATEGIES_DIR):
            found += strategy_violations(path.read_text(encoding="utf-8"), name)
    assert found == []


def test_run_folder_layout_spelled_only_in_run_dir() -> None:
    files = _project_files(REPO)
    assert RUN_LAYOUT_OWNER in files and layout_literals(files[RUN_LAYOUT_OWNER].read_text(encoding="utf-8"))
    found = [hit for name, path in files.items() if name != RUN_LAYOUT_OWNER
             for hit in layout_literals(path.read_text(encoding="utf-8"), name)]
    assert found == [], "use toolkit.runtime.run_dir.RunLayout for a run's paths"
    assert layout_literals('ckpt = out / "checkpoints"') == ["<src>:1: 'checkpoints'"]  # the rule can fail
    assert layout_literals('msg = f"{out}/final was not written"') == []  # prose about the folder is fine


def test_the_rules_catch_what_they_name() -> None:
    """Each rule flags a sample of what it forbids (so the checks above can fail), and nothing in a clean one."""
    samples = {
        "import deepspeed": "imports deepspeed",
        "from deepspeed.utils import safe_get_full_fp32_param": "imports deepspeed.utils",
        "from torch.distributed.tensor import distribute_tensor": "imports torch.distributed.tensor",
        "from torch.distributed.fsdp import fully_shard": "imports torch.distributed.fsdp",
        "from transformers.integrations import deepspeed": "imports transformers.integrations.deepspeed",
        "def f(t):\n    return isinstance(t, DTensor)": "names DTensor",
        "x = a.distributed_type == DistributedType.DEEPSPEED": "DistributedType.DEEPSPEED",
        "x = kind == 'FSDP'": "string 'FSDP'",
        "n = getattr(p, 'ds_numel', p.numel())": "attribute name 'ds_numel'",
        "cfg = acc.state.deepspeed_plugin": "attribute .deepspeed_plugin",
        "y = t.full_tensor()": "attribute .full_tensor",
        "z = opt.single_partition_of_fp32_groups": "attribute .single_partition_of_fp32_groups",
    }
    for source, what in samples.items():
        assert [v.split(": ", 1)[1] for v in strategy_violations(source)][:1] == [what], source
    clean = "from toolkit.strategies import deepspeed\nx = os.environ['ACCELERATE_USE_DEEPSPEED']\ny = 'zero3'"
    assert strategy_violations(clean) == []
    inside_a_function = "def build():\n    from transformers.integrations import deepspeed"
    assert strategy_violations(inside_a_function) != []
    assert find_cycles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]
    assert find_cycles([("a", "b"), ("b", "c")]) == []


def test_import_edges_resolve_packages_and_laziness(tmp_path: Path) -> None:
    (tmp_path / "toolkit" / "strategies").mkdir(parents=True)
    (tmp_path / "toolkit" / "__init__.py").write_text("")
    (tmp_path / "toolkit" / "strategies" / "__init__.py").write_text("")
    (tmp_path / "toolkit" / "strategies" / "deepspeed.py").write_text("from toolkit.strategies import x\n")
    (tmp_path / "toolkit" / "a.py").write_text("from toolkit.strategies import deepspeed\n")
    (tmp_path / "toolkit" / "b.py").write_text("def f():\n    # deferred: a imports b\n    from toolkit import a\n")
    edges = {(e.source, e.target, e.lazy, e.commented) for e in import_edges(tmp_path)}
    # toolkit.strategies.deepspeed -> its own package and toolkit.* -> toolkit are not edges (initialised first)
    assert edges == {("toolkit.a", "toolkit.strategies", False, False),
                     ("toolkit.a", "toolkit.strategies.deepspeed", False, False),
                     ("toolkit.b", "toolkit.a", True, True)}


def test_tests_mirror_the_packages() -> None:
    """tests/<package>/ holds the in-process tests of toolkit/<package>/; tests/e2e/ what launches the trainer or the
    CLI, tests/helpers/ the scripts tests run, tests/assets/ their data; repository-wide checks stay at the top."""
    folders = {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    packages = {p.parent.name for p in (REPO / "toolkit").glob("*/__init__.py")}
    assert folders - packages == {"e2e", "helpers", "assets"}, folders - packages
    loose = sorted(p.name for p in (REPO / "tests").glob("test_*.py"))
    leaves = {f"test_{m.removeprefix('toolkit.')}.py" for m in LAYERS[0] if m != "toolkit"}
    assert set(loose) - leaves <= {"test_structure.py", "test_docs_links.py"}, loose


def test_the_entry_reads_in_one_sitting() -> None:
    """train_curriculum.py stays a page a reader takes in at once: `train()` (config, accelerator, data, model,
    optimizer, prepare, resume, loop, save) at most 100 lines, the file at most 250, and no module-level name that
    shadows one it imports (`exit_code` was both signals' function and `__main__`'s result)."""
    source = (REPO / "train_curriculum.py").read_text()
    tree = ast.parse(source)
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert train.end_lineno - train.lineno + 1 <= 100, train.end_lineno - train.lineno + 1
    assert len(source.splitlines()) <= 250, len(source.splitlines())
    imported = {alias.asname or alias.name for n in tree.body if isinstance(n, ast.ImportFrom | ast.Import)
                for alias in n.names}
    module_level = [n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.ClassDef)]  # `__main__` too
    assigned = {t.id for top in module_level for n in ast.walk(top) if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Name)}
    assert not imported & assigned, imported & assigned
