"""No module outside longctx/ops/ decides anything by a context-parallel strategy's name: the model,
the planner, the memory model, the reports and the config ask the strategy object
(ops/strategy.py), so a new strategy is a module and a registry line, and none of them falls
through to another strategy's price. Read from the source, nothing imported but the names."""
import os
import re

from longctx.ops import context_parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONGCTX = os.path.join(ROOT, "longctx")


def _name_patterns(names):
    """What deciding by a name looks like: compared (== / !=, either side), looked up in a literal
    collection (`in ("ulysses", "usp")`), or a key of a table written per strategy."""
    quoted = "[\"'](?:" + "|".join(map(re.escape, names)) + ")[\"']"
    return [re.compile(rf"(?:==|!=)\s*{quoted}"), re.compile(rf"{quoted}\s*(?:==|!=)"),
            re.compile(rf"\bin\s*[\(\[\{{][^\)\]\}}]*{quoted}"), re.compile(rf"[\{{,]\s*{quoted}\s*:")]


def strategy_name_decisions(root: str, names) -> list[str]:
    """`path:line: text` of every line under `root` but its ops/ that decides by a name."""
    patterns = _name_patterns(names)
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if os.path.relpath(folder, root).split(os.sep)[0] == "ops":
            continue
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if any(p.search(line) for p in patterns):
                        found.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    return found


def test_no_strategy_name_is_compared_outside_ops():
    found = strategy_name_decisions(LONGCTX, context_parallel.STRATEGIES)
    assert not found, "ask the strategy object (ops/strategy.py) instead:\n" + "\n".join(found)


def test_the_search_finds_each_way_of_deciding_by_a_name(tmp_path):
    """The patterns catch what the modules used to write (else the test above proves nothing)."""
    package = tmp_path / "pkg"
    (package / "ops").mkdir(parents=True)
    (package / "plan").mkdir()
    (package / "ops" / "allowed.py").write_text('if strategy == "ring":\n    pass\n')
    (package / "plan" / "model.py").write_text(
        'a = cp if cp != "usp" else 1\n'
        'b = strategy in ("all_gather", "ulysses")\n'
        'c = {"ring": 0, "halo": 2}\n'
        'd = "halo" == strategy\n'
        'e = collective("all_gather", 1)\n')
    found = strategy_name_decisions(str(package), context_parallel.STRATEGIES)
    assert [line.split(": ", 1)[1] for line in found] == [
        'a = cp if cp != "usp" else 1', 'b = strategy in ("all_gather", "ulysses")',
        'c = {"ring": 0, "halo": 2}', 'd = "halo" == strategy']
