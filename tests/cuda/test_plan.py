"""KernelPlan: the defaults, and the text form tools and scripts A/B plans with (no GPU)."""

import pytest

from ninfer.gpu.cuda.plan import DEFAULT, EPILOGUES, FOLDS, KernelPlan, parse_plan


def test_default_plan_takes_every_fold_and_epilogue():
    assert DEFAULT == KernelPlan()
    assert DEFAULT.folds == frozenset(FOLDS) and DEFAULT.epilogues == frozenset(EPILOGUES)
    assert DEFAULT.wide_shape_of("Q8_0") == (2, 4) and DEFAULT.wide_shape_of("Q6_K") is None
    hash(DEFAULT)  # frozen and hashable: kernels may be cached by plan fields


def test_parse_plan_changes_only_the_named_fields():
    assert parse_plan("") == DEFAULT
    plan = parse_plan("one_row_split=False; wide_shape={'Q8_0': (1, 2)}; folds=()")
    assert not plan.one_row_split and plan.folds == frozenset()
    assert plan.wide_shape_of("Q8_0") == (1, 2) and plan.wide_shape_of("Q4_1") == DEFAULT.wide_shape_of("Q4_1")
    assert plan.epilogues == DEFAULT.epilogues and plan.evict_first


@pytest.mark.parametrize("text", ["no_such_field=1", "pdl", "folds=('attn_norm', 'typo')"])
def test_parse_plan_rejects_what_it_cannot_read(text):
    with pytest.raises(ValueError):
        parse_plan(text)
