"""ejax's import graph, read statically from the sources (every import, function-level ones too):
no cycles, and no package importing one above it."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ejax"

# package -> packages it must never import (the layers above it)
FORBIDDEN = {
    "parallel": ("train", "models", "data", "sim", "eval", "rl", "serve"),
    "kernels": ("train", "models", "data", "sim", "eval", "rl", "serve"),
    "models": ("train", "eval", "rl", "serve"),
    "data": ("models", "train", "eval", "rl", "serve"),
    "sim": ("models", "train", "eval", "rl", "serve"),
}


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
  parts = ("ejax",) + path.relative_to(root).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
  """module -> the ejax modules it imports (a name imported from a package counts as its submodule
  where one of that name exists, else as the package)."""
  paths = {module_name(p, root): p for p in root.rglob("*.py")}
  graph = {}
  for name, path in paths.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        imported.update(alias.name for alias in node.names)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(anchor + ([node.module] if node.module else []))
        imported.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base for alias in node.names)
    graph[name] = {other for other in imported if other in paths and other != name}
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for other in sorted(graph[node]):
      if other not in index:
        visit(other)
        low[node] = min(low[node], low[other])
      elif other in on_stack:
        low[node] = min(low[node], index[other])
    if low[node] == index[node]:
      component = []
      while not component or component[-1] != node:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      if len(component) > 1:
        found.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return found


def test_cycles_finds_a_planted_cycle(tmp_path):
  (tmp_path / "a.py").write_text("from ejax import b\n")
  (tmp_path / "b.py").write_text("def f():\n  import ejax.a\n")
  (tmp_path / "c.py").write_text("from ejax import a\n")
  graph = import_graph(tmp_path)
  assert graph == {"ejax.a": {"ejax.b"}, "ejax.b": {"ejax.a"}, "ejax.c": {"ejax.a"}}
  assert cycles(graph) == [["ejax.a", "ejax.b"]]


def test_ejax_has_no_import_cycles():
  graph = import_graph()
  assert len(graph) > 100 and "ejax.data.sources" in graph["ejax.data.stats"]
  assert cycles(graph) == []


def test_no_package_imports_one_above_it():
  upward = [f"{name} -> {other}" for name, imported in import_graph().items() for other in imported
            if other.split(".")[1] in FORBIDDEN.get(name.split(".")[1], ())]
  assert upward == []


# The generic trainer and policy reach a model through the registry alone: its spec's hooks bring what
# a model or its optional modules (model.perception) add. ejax.models.layers is the generic parameter
# machinery the train state initialises with (deferred_init), no model.
TRAIN_MAY_IMPORT = ("ejax.models.registry", "ejax.models.layers")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
  """Imports that break the layers' rules: ejax/train/ imports no simulator and no model but through
  TRAIN_MAY_IMPORT; ejax/models/ imports no simulator and no trainer."""
  found = []
  for name, imported in sorted(graph.items()):
    layer = name.split(".")[1] if name.count(".") else ""
    for other in sorted(imported):
      if layer == "train" and (other.startswith("ejax.sim") or
                               other.startswith("ejax.models") and other not in TRAIN_MAY_IMPORT):
        found.append(f"{name} -> {other}")
      if layer == "models" and other.startswith(("ejax.sim", "ejax.train")):
        found.append(f"{name} -> {other}")
  return found


def test_layer_rules_catch_planted_imports(tmp_path):
  for package in ("train", "models", "models/groot", "sim", "data"):
    (tmp_path / package).mkdir(parents=True, exist_ok=True)
    (tmp_path / package / "__init__.py").write_text("")
  (tmp_path / "models" / "registry.py").write_text("")
  (tmp_path / "models" / "layers.py").write_text("")
  (tmp_path / "sim" / "registry.py").write_text("")
  (tmp_path / "data" / "tasks.py").write_text("from ejax.sim import registry\n")
  (tmp_path / "train" / "policy.py").write_text(
      "from ejax.models import registry, layers\nfrom ejax.data import tasks\n"
      "def f():\n  from ejax.models import groot\n  import ejax.sim.registry\n")
  (tmp_path / "models" / "tokenizer.py").write_text("from ejax.sim import registry\nfrom ejax.train import policy\n")
  assert layer_violations(import_graph(tmp_path)) == [
      "ejax.models.tokenizer -> ejax.sim.registry", "ejax.models.tokenizer -> ejax.train.policy",
      "ejax.train.policy -> ejax.models.groot", "ejax.train.policy -> ejax.sim.registry"]


def test_train_imports_no_model_and_no_simulator_and_models_no_simulator():
  """ejax/train/ reaches a model through ejax.models.registry alone and the simulator not at all (the
  tasks a policy was trained on come from the data layer, ejax.data.tasks); ejax/models/ imports
  neither the simulator nor the trainer."""
  graph = import_graph()
  assert "ejax.models.registry" in graph["ejax.train.policy"]
  assert layer_violations(graph) == []


# The data layer's entries to the simulator: its recorded demonstrations as a dataset, and their tasks
# and instructions (the tasks a policy trained on, a local tokenizer's vocabulary).
SIM_ENTRIES = ("ejax.data.sources", "ejax.data.tasks")


def test_models_and_train_reach_the_simulator_only_through_the_data_layers_entries():
  """Following imports from any module of ejax/models/ or ejax/train/, the first module that imports
  ejax.sim is one of SIM_ENTRIES (models: ejax.data.tasks alone)."""
  graph = import_graph()

  def sim_importers_reached(start):
    seen, stack = {start}, [start]
    while stack:
      for other in graph[stack.pop()]:
        if other not in seen and not other.startswith("ejax.sim"):
          seen.add(other)
          stack.append(other)
    return {name for name in seen if any(other.startswith("ejax.sim") for other in graph[name])}

  reached = {layer: set() for layer in ("models", "train")}
  for name in graph:
    layer = name.split(".")[1] if name.count(".") else ""
    if layer in reached:
      reached[layer] |= sim_importers_reached(name)
  assert reached["models"] == {"ejax.data.tasks"}
  assert reached["train"] <= set(SIM_ENTRIES) and "ejax.data.sources" in reached["train"]
