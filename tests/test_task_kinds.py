"""Task kinds: one class per kind of output owns what differs, and no module outside ``luna_convert/task_kinds/``
branches on a kind (CONTRIBUTING.md, *Adding a task*)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from luna_convert.task_kinds import KINDS, TaskKind, check_head, kind_named, kind_of
from luna_convert.tasks import TASKS, get_task

PACKAGE = Path(__file__).resolve().parents[1] / "luna_convert"
HOME = PACKAGE / "task_kinds"
# The names a branch on a kind would compare with: the kinds', and the tasks' that are the only one of their kind.
KIND_WORDS = frozenset(KINDS) | {name for name, spec in TASKS.items() if spec.level != "sequence"}
KIND_FLAGS = frozenset({"level", "is_token_level", "is_span_level", "is_embedding_level"})
KIND_CLASSES = frozenset(type(kind).__name__ for kind in KINDS.values()) | {"TaskKind"}


def kind_branches(source: str) -> list[str]:
    """Where ``source`` branches on a task kind: reads a TaskSpec's ``level`` (or an ``is_*_level`` flag), compares
    with a kind's name or a one-of-its-kind task's name, or tests ``isinstance`` against a kind class."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in KIND_FLAGS:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            words = [o.value for o in operands if isinstance(o, ast.Constant) and o.value in KIND_WORDS]
            words += [e.value for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set))
                      for e in o.elts if isinstance(e, ast.Constant) and e.value in KIND_WORDS]
            if words:
                found.append(f"line {node.lineno}: compares with {words[0]!r}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
              and any(isinstance(n, ast.Name) and n.id in KIND_CLASSES for n in ast.walk(node.args[1]))):
            found.append(f"line {node.lineno}: isinstance against a kind")
    return found


def test_no_module_outside_the_kinds_home_branches_on_a_kind():
    """The pipeline, engine, scoring, pre-flight, data, metrics and reports call the kind's hooks instead."""
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if HOME not in p.parents and p.name != "tasks.py"]
    assert len(outside) > 100
    found = [f"{p.relative_to(PACKAGE)} {hit}" for p in outside for hit in kind_branches(p.read_text())]
    assert not found, "branches on a task kind outside luna_convert/task_kinds/:\n" + "\n".join(found)


def test_the_branch_check_can_fail():
    for source in ('if task.level == "token": pass', "x = spec.is_span_level", 'ok = task.name == "qa"',
                   'ok = name in ("span", "sequence")', "ok = isinstance(kind, SpanKind)",
                   'tag = "a" if task.name != "embedding" else "b"'):
        assert kind_branches(source), source
    for source in ('if task.kind == "image": pass', 'ok = task.name == "digits"', "ok = kind.span_logits",
                   'stacklevel = 2', 'ok = isinstance(x, str)'):
        assert not kind_branches(source), source


def test_the_kinds_home_reads_level_in_one_place():
    """``kind_of`` is the one reader of ``TaskSpec.level``; the kinds themselves never branch on each other."""
    hits = {p.name: kind_branches(p.read_text()) for p in sorted(HOME.glob("*.py"))}
    assert len([hit for hit in hits.pop("__init__.py") if hit.endswith(": .level")]) == 1
    assert not any(hits.values()), hits


def test_every_task_names_a_kind_and_each_kind_is_one_class():
    assert {spec.level for spec in TASKS.values()} == set(KINDS) == {"sequence", "token", "span", "embedding"}
    assert all(isinstance(kind, TaskKind) and kind.name == name for name, kind in KINDS.items())
    assert len({type(kind) for kind in KINDS.values()}) == len(KINDS)
    assert kind_of("ner") is KINDS["token"] and kind_of("squad") is KINDS["span"] and kind_of("sst2") is KINDS["sequence"]
    assert kind_named(KINDS["span"]) is KINDS["span"]
    with pytest.raises(Exception, match="unknown task kind 'tokens'"):
        kind_named("tokens")


@pytest.mark.parametrize("task,tag,auto_class", [
    ("sst2", "text-classification", "AutoModelForSequenceClassification"),
    ("digits", "image-classification", "AutoModelForSequenceClassification"),
    ("ner", "token-classification", "AutoModelForTokenClassification"),
    ("qa", "question-answering", "AutoModelForQuestionAnswering"),
    ("embedding", "sentence-similarity", None),
])
def test_each_kind_says_its_model_cards_tag_and_its_head(task, tag, auto_class):
    kind = kind_of(task)
    assert kind.pipeline_tag(get_task(task)) == tag and kind.auto_class == auto_class
    assert kind.span_logits == (task == "qa") and kind.sentence_encoder == (task == "embedding")


def test_each_kind_refuses_the_heads_of_the_others():
    check_head(kind_of("sst2"), ["BertForSequenceClassification"], "m")
    check_head(kind_of("ner"), ["BertForTokenClassification"], "m")
    with pytest.raises(Exception, match="is a question-answering model .*--task qa"):
        check_head(kind_of("sst2"), ["BertForQuestionAnswering"], "m")
    with pytest.raises(Exception, match="is not a token-classification model .*BertForTokenClassification"):
        check_head(kind_of("ner"), ["BertForSequenceClassification"], "m")
    with pytest.raises(Exception, match="is a token-classification \\(NER\\) model"):
        check_head(kind_of("qa"), ["BertForTokenClassification"], "m")


def test_each_kind_names_its_metrics():
    assert kind_of("ner").metric_names(get_task("ner"))[0] == "entity_f1"
    assert kind_of("qa").metric_names(get_task("qa")) == ("f1", "exact_match")
    assert kind_of("stsb").metric_names(get_task("stsb")) == ("pearson", "spearmanr")
    embedding = get_task("embedding")
    assert set(kind_of(embedding).metric_choices(embedding)) == {"spearmanr", "pearson", "teacher_cosine",
                                                                 "topk_agreement"}
