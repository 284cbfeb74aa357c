"""The tensor-parallel degree rules (core/degrees.py), each against hand-computed values, and a scan of the package
that fails when one of them is written inline again outside its home."""

import ast
import re
from pathlib import Path

import pytest

from bdlora_train.core import degrees
from bdlora_train.core.degrees import (
    base_shards,
    check_divides,
    check_rank,
    check_segments,
    divides,
    ep_layout_fits,
    ep_layout_fixes,
    heads_split,
    kv_replicated,
    per_rank_rank,
    segments_split,
    servable_degrees,
    splitting_degrees,
)
from bdlora_train.core.errors import BlockDiagLoraConfigError, ExportError, RecipeError, ServingError, TPError
from bdlora_train.core.heads import head_divisors

PACKAGE = Path(__file__).resolve().parents[2] / "bdlora_train"
HOME = Path("core") / "degrees.py"


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# --- the rules, one by one ------------------------------------------------------------------------------------------


def test_divides():
    assert divides(2, 8) and divides(8, 8) and divides(1, 7) and divides(3, 24)
    assert not divides(3, 8) and not divides(16, 8) and not divides(5, 24)
    assert not divides(0, 8) and not divides(-2, 8)  # a degree below 1 divides nothing (and never raises)


def test_servable_degrees_are_the_divisors_of_nblocks():
    assert servable_degrees(8) == [1, 2, 4, 8]
    assert servable_degrees(6) == [1, 2, 3, 6]
    assert servable_degrees(1) == [1]
    assert servable_degrees(7) == [1, 7]
    # with head counts only those that also split the heads: Qwen2.5-7B (28 heads, 4 KV heads) at nblocks 8
    assert servable_degrees(8, heads=28, kv=4) == [1, 2, 4]
    assert servable_degrees(12, heads=9, kv=3) == [1, 3]  # SmolLM2-135M: 9 heads, 3 KV heads
    assert servable_degrees(8, heads=32, kv=8) == [1, 2, 4, 8]  # Llama-3.1-8B
    assert servable_degrees(6, heads=12) == [1, 2, 3, 6]  # kv defaults to the heads (no GQA)


def test_splitting_degrees_pass_every_rule_they_are_given():
    assert splitting_degrees(nblocks=8, r=12) == [1, 2, 4]
    assert splitting_degrees(heads=9, kv=3) == [1, 3]  # up to 8 by default
    assert splitting_degrees(16, heads=32, kv=8) == [1, 2, 4, 8]
    assert splitting_degrees(segments=(3072, 1024, 1024), r=12) == [1, 2, 4]
    assert splitting_degrees(6) == [1, 2, 3, 4, 5, 6]


def test_check_divides_names_the_degree_the_rule_and_the_degrees_that_work():
    check_divides(2, 8, "export")  # passes: nothing raised
    with pytest.raises(ExportError) as err:
        check_divides(3, 8, "export", key="--reblock", error=ExportError)
    line = _one_line(err)
    assert line.startswith("export: --reblock=3 does not divide nblocks=8")
    assert "whole blocks" in line and line.endswith("use --reblock in [1, 2, 4, 8]")
    with pytest.raises(TPError) as err:  # with head counts, only degrees that also split them (28 / 4)
        check_divides(3, 8, "tp: m", key="--tp", heads=28, kv=4, error=TPError)
    assert _one_line(err).endswith("use --tp in [1, 2, 4]")
    with pytest.raises(BlockDiagLoraConfigError) as err:  # the default error type; the caller's own fix
        check_divides(4, 2, "tp: m", key="tp_size", fix="use nblocks=4")
    assert "tp_size=4 does not divide nblocks=2" in _one_line(err) and _one_line(err).endswith("; use nblocks=4")


def test_check_rank_names_the_nearest_ranks_that_split():
    check_rank(24, 8, "recipe")
    with pytest.raises(RecipeError) as err:
        check_rank(10, 4, "recipe", key="lora_r", error=RecipeError)
    assert _one_line(err) == "recipe: lora_r=10 is not a multiple of nblocks=4; use lora_r=8 or lora_r=12"
    with pytest.raises(BlockDiagLoraConfigError) as err:  # below N: N itself is the only smaller choice
        check_rank(2, 4, "cfg")
    assert _one_line(err) == "cfg: r=2 is not a multiple of nblocks=4; use r=4"


def test_the_rank_rule_has_one_home():
    from bdlora_train.core import roles

    assert not hasattr(roles, "check_rank")  # core/degrees.py only


def test_per_rank_rank_is_exact_and_refuses_a_rank_the_degree_does_not_divide():
    assert per_rank_rank(8, 2) == 4
    assert per_rank_rank(24, 8) == 3
    assert per_rank_rank(16, 1) == 16
    # no rounding either way: r=6 at TP 4 would leave ranks holding 1 or 2 rank columns (vLLM's plugin refuses it)
    with pytest.raises(ServingError) as err:
        per_rank_rank(6, 4, "serve: m", blocks="--tensor-parallel-size", error=ServingError)
    assert _one_line(err) == "serve: m: r=6 is not a multiple of --tensor-parallel-size=4; use r=4 or r=8"


def test_segments_split_phi3_qkv():
    phi3_qkv = (3072, 1024, 1024)  # Phi-3-mini qkv_proj: [q | k | v]
    assert segments_split(phi3_qkv, 4) and segments_split(phi3_qkv, 8)
    assert not segments_split(phi3_qkv, 3)  # 3072 / 3 = 1024 splits, 1024 / 3 does not
    assert segments_split((96,), 3) and not segments_split((96,), 5)
    assert segments_split((), 7)  # nothing to split


def test_check_segments_names_the_segments_and_the_values_that_split_them():
    check_segments((3072, 1024, 1024), 4, "qkv_proj")
    with pytest.raises(BlockDiagLoraConfigError) as err:
        check_segments((3072, 1024, 1024), 3, "qkv_proj")
    line = _one_line(err)
    assert line.startswith("qkv_proj: segments=[3072, 1024, 1024] not all divisible by nblocks=3")
    assert line.endswith("use nblocks in [1, 2, 4, 8]")
    with pytest.raises(TPError) as err:  # the rank and the heads narrow the suggestion (12: no 8; 6 heads: no 4)
        check_segments((96,), 5, "tp: o_proj", blocks="--tp", r=12, heads=6, kv=6, error=TPError)
    assert _one_line(err).startswith("tp: o_proj: segments=96 not all divisible by --tp=5")
    assert _one_line(err).endswith("use --tp in [1, 2, 3, 6]")


def test_heads_split_and_kv_replication():
    assert heads_split(9, 3, 3) and heads_split(9, 3, 1)  # SmolLM2-135M at 3
    assert not heads_split(9, 3, 6) and not heads_split(9, 3, 9)
    assert heads_split(32, 8, 8) and not heads_split(32, 8, 16)  # Llama-3.1-8B
    assert heads_split(12, None, 4)  # kv defaults to the heads
    # TP above the KV heads and a multiple of them: vLLM replicates KV heads, the base shards, BD blocks do not align
    assert kv_replicated(6, 3, 6) and kv_replicated(9, 3, 9) and kv_replicated(32, 8, 16)
    assert not kv_replicated(9, 3, 3)  # 3 splits the KV heads: nothing replicated
    assert not kv_replicated(9, 3, 6)  # 6 does not divide the 9 attention heads
    assert kv_replicated(8, 2, 4)  # 4 divides 8 heads, 4 > 2 KV heads, 4 = 2 x 2
    assert not kv_replicated(12, 4, 6)  # 6 > 4 but not a multiple of 4
    assert base_shards(6, 3, 6) and base_shards(9, 3, 3)
    assert not base_shards(6, 3, 4) and not base_shards(9, 3, 6) and not base_shards(12, 4, 6)


def test_head_divisors_use_the_heads_rule():
    class Config:
        num_attention_heads, num_key_value_heads = 9, 3

    assert head_divisors(Config()) == [1, 3]
    Config.num_attention_heads, Config.num_key_value_heads = 28, 4
    assert head_divisors(Config()) == [1, 2, 4]
    assert head_divisors(Config(), limit=2) == [1, 2]


def test_the_serve_plan_holds_exactly_r_over_tp_and_fails_a_rank_tp_does_not_divide():
    """The plan and vLLM's plugin (vllm_plugin/patch.py, which refuses a rank TP does not divide) use one rule."""
    from types import SimpleNamespace

    from bdlora_train.serving.plan import _held_ranks, _rank_check

    modules = {
        "m.q_proj": SimpleNamespace(role="bd_b", structure=None, r=8),
        "m.qkv_proj": SimpleNamespace(role=None, structure={"role": "bd_b"}, r=16),  # densely stored blocks
        "m.lm_head": SimpleNamespace(role=None, structure=None, r=8),  # plain LoRA: every rank holds all of it
    }
    adapter = SimpleNamespace(bd_nblocks=4, modules=modules)
    assert _held_ranks(adapter, 2, "plugin") == {"m.q_proj": 4, "m.qkv_proj": 8, "m.lm_head": 8}
    assert _held_ranks(adapter, 4, "plugin") == {"m.q_proj": 2, "m.qkv_proj": 4, "m.lm_head": 8}
    assert _held_ranks(adapter, 2, "dense-lora") == {"m.q_proj": 8, "m.qkv_proj": 16, "m.lm_head": 8}
    checks = []
    assert _rank_check(adapter, 2, "plugin", None, checks) == 8 and checks[0].status == "ok"
    checks = []
    _rank_check(adapter, 3, "plugin", None, checks)  # 8 / 3 is no rank: never rounded up (nor down)
    assert [c.status for c in checks] == ["fail"]
    assert checks[0].message.startswith("m.q_proj: r=8 is not a multiple of --tensor-parallel-size 3")
    assert checks[0].message.endswith("fix: serve at --tensor-parallel-size in [1, 2, 4]")


def test_tp_training_refuses_blocks_that_do_not_split_over_the_ranks():
    from bdlora_train.models import load_config, meta_model
    from bdlora_train.peft_integration.config import BlockDiagLoraConfig
    from bdlora_train.peft_integration.resolve import resolve
    from bdlora_train.tp_runtime.preflight import check_tp_training

    meta = meta_model(load_config("tiny:llama"))  # 4 heads, 2 KV heads
    config = BlockDiagLoraConfig(r=4, nblocks=2, target_modules=["q_proj", "o_proj"])
    assert set(check_tp_training(meta, resolve(meta, config, 2), 2).values()) == {"colwise", "rowwise"}
    config = BlockDiagLoraConfig(r=4, nblocks=1, target_modules=["q_proj", "o_proj"])
    with pytest.raises(TPError) as err:
        check_tp_training(meta, resolve(meta, config, 1), 2)
    line = _one_line(err)
    assert "tp_size=2 does not divide nblocks=1" in line and "use nblocks=2 (the default under TP)" in line


# --- no inline copy outside the home ----------------------------------------------------------------------------------

# A modulo whose operand is (or is an attribute named, or a name ending in `_` plus) one of these is a TP rule: the
# degree, the blocks, and the head counts the degree must split.
RULE_NAMES = re.compile(r"(?:^|_)(tp|tp_size|nblocks|world|degree|heads|kv)$")


def _operand_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def inline_rules(source: str, filename: str = "<string>") -> list[str]:
    """`file:line: expression` for every `%` modulo (or `%=`) on a TP-rule operand; string formatting (a str or
    f-string left operand) is not a modulo."""
    hits = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            left, right = node.left, node.right
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Mod):
            left, right = node.target, node.value
        else:
            continue
        if isinstance(left, ast.JoinedStr) or (isinstance(left, ast.Constant) and isinstance(left.value, (str, bytes))):
            continue
        names = [_operand_name(left), _operand_name(right)]
        if any(name and RULE_NAMES.search(name) for name in names):
            hits.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return hits


def scan(root: Path) -> list[str]:
    hits = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root) == HOME:
            continue
        hits += inline_rules(path.read_text(), str(path.relative_to(root)))
    return hits


PLANTED = """
def f(adapter, self, shard, tp, n, r, x):
    a = adapter.bd_nblocks % tp          # 3: both operands
    b = self.tp_size % 2                 # 4: attribute on the left
    c = r % shard.world                  # 5: attribute on the right
    d = [k for k in range(1, n) if n % k == 0]   # 6: not a rule name: not caught
    x %= degree                          # 7: augmented
    e = "%d ranks" % tp                  # 8: formatting, not a modulo
    g = b"%d" % tp                       # 9: formatting
    h = layout_nblocks % 4               # 10: a name ending in _nblocks
    i = tp_sizes % 2                     # 11: not a rule name
    j = (r * 2) % nblocks                # 12: an expression on the left
    k = config.num_key_value_heads % n   # 13: a head count
    m = [q for q in range(1, 9) if kv % q == 0]  # 14: the KV heads
    return a, b, c, d, e, g, h, i, j, k, m
"""


def test_the_scanner_catches_a_planted_inline_rule():
    lines = sorted(int(hit.split(":")[1]) for hit in inline_rules(PLANTED))
    assert lines == [3, 4, 5, 7, 10, 12, 13, 14]


def test_the_scanner_skips_only_the_home(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "degrees.py").write_text("def divides(degree, n):\n    return n % degree == 0\n")
    (tmp_path / "serving").mkdir()
    (tmp_path / "serving" / "plan.py").write_text("def check(nblocks, tp):\n    return nblocks % tp\n")
    (tmp_path / "core" / "other.py").write_text("def ok(a, b):\n    return a % b\n")
    assert scan(tmp_path) == ["serving/plan.py:2: nblocks % tp"]


def test_no_tp_rule_is_written_inline_outside_core_degrees():
    assert (PACKAGE / HOME).is_file() and inline_rules((PACKAGE / HOME).read_text())  # the home does hold them
    hits = scan(PACKAGE)
    assert not hits, "TP rules written inline; call bdlora_train/core/degrees.py instead:\n" + "\n".join(hits)


def test_the_home_is_pure():
    """No torch, PEFT or transformers: the rules are arithmetic (and vLLM's plugin imports them)."""
    tree = ast.parse(Path(degrees.__file__).read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Import)]
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert modules == {"__future__", "collections.abc", "bdlora_train.core.errors"}


def test_ep_layout_fixes_pass_every_rule_and_are_found_when_one_change_would_do():
    """Every suggested expert-parallel layout passes ep_layout_fits with the facts given (the launch, the experts);
    a layout one key away that passes is always among them; the issue's case (ep_size=3 on 2 processes, 4 experts)
    gets ep_size=2 and not fsdp_size=3, which the expert count refuses."""
    assert ep_layout_fixes(1, 2, 3, 1, processes=2, experts=4) == [{"ep_size": 2}]
    assert ep_layout_fixes(1, 2, 3, 1, processes=None, experts=None) == [{"ep_size": 2}, {"fsdp_size": 3}]
    assert ep_layout_fixes(1, 2, 3, 1, processes=3, experts=4) == []  # 3 processes never split 4 experts whole
    assert ep_layout_fits(2, 2, 4, 1, processes=4, experts=8) and not ep_layout_fits(2, 2, 4, 1, 8, 8)
    checked = 0
    for tp in (1, 2):
        for fsdp in range(1, 5):
            for ep in range(2, 7):
                for processes in (None, *range(1, 9)):
                    for experts in (None, 4, 6, 8):
                        fixes = ep_layout_fixes(tp, fsdp, ep, 1, processes, experts)
                        for fix in fixes:
                            new = {"fsdp_size": fsdp, "ep_size": ep, **fix}
                            assert ep_layout_fits(tp, new["fsdp_size"], new["ep_size"], 1, processes, experts), fix
                            assert new["ep_size"] > 1
                        one_key = [
                            {"ep_size": e} for e in range(2, 13) if ep_layout_fits(tp, fsdp, e, 1, processes, experts)
                        ] + [{"fsdp_size": f} for f in range(1, 13) if ep_layout_fits(tp, f, ep, 1, processes, experts)]
                        for fix in one_key:
                            if fix != {"ep_size": ep} and fix != {"fsdp_size": fsdp}:
                                assert fix in fixes, (tp, fsdp, ep, processes, experts, fix, fixes)
                        checked += 1
    assert checked == 2 * 4 * 5 * 9 * 4


# The role vocabulary has one home too: core/roles.py (the two roles, PLAIN, `is_block_diagonal`) and core/layout.py
# (the role -> side and role -> factor tables). A second copy is a dict keyed by both roles, a membership test against
# both roles written out, or the literal "plain" in code.
ROLE_HOMES = {Path("core") / "roles.py", Path("core") / "layout.py"}
ROLE_NAMES = {"BD_A", "BD_B"}
ROLE_STRINGS = {"bd_a", "bd_b"}


def _is_role(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in ROLE_NAMES) or (
        isinstance(node, ast.Constant) and node.value in ROLE_STRINGS
    )


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, nodes) and node.body and isinstance(node.body[0], ast.Expr)
    }


def role_table_copies(source: str, filename: str = "<string>") -> list[str]:
    """`file:line: expression` for every second copy of the role vocabulary in `source`."""
    tree = ast.parse(source, filename)
    docstrings = _docstrings(tree)
    hits = []
    for node in ast.walk(tree):
        copy = False
        if isinstance(node, ast.Dict):  # {BD_B: ..., BD_A: ...}: a role table
            copy = sum(key is not None and _is_role(key) for key in node.keys) == 2
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            copy = any(  # role in (BD_A, BD_B): is_block_diagonal written out
                isinstance(c, (ast.Tuple, ast.Set, ast.List)) and len(c.elts) == 2 and all(map(_is_role, c.elts))
                for c in node.comparators
            )
        elif isinstance(node, ast.Constant) and node.value == "plain" and id(node) not in docstrings:
            copy = True  # core.roles.PLAIN
        if copy:
            hits.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return hits


PLANTED_ROLES = '''
def f(role, side):
    """Roles are "plain" or block-diagonal."""
    a = {BD_B: "column", BD_A: "row"}[role]      # 4: a role -> side table
    b = role in (BD_A, BD_B)                     # 5: is_block_diagonal
    c = role not in {"bd_b", "bd_a"}             # 6: spelled as strings
    d = role if b else "plain"                   # 7: PLAIN
    e = {BD_B: 1}                                # 8: one role: not a table
    g = role in (BD_A, PLAIN)                    # 9: not both roles
    return a, b, c, d, e, g
'''


def test_the_role_scanner_catches_planted_copies():
    assert sorted(int(hit.split(":")[1]) for hit in role_table_copies(PLANTED_ROLES)) == [4, 5, 6, 7]


def test_the_role_vocabulary_is_written_once():
    homes = [role_table_copies((PACKAGE / home).read_text(), str(home)) for home in sorted(ROLE_HOMES)]
    assert any(homes)  # the homes do hold the table and the literal
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE) not in ROLE_HOMES:
            hits += role_table_copies(path.read_text(), str(path.relative_to(PACKAGE)))
    assert not hits, "role tables or literals outside core/roles.py and core/layout.py:\n" + "\n".join(hits)
