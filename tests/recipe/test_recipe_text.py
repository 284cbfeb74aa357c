"""train.recipe_text (recipe values from YAML and `key=value` text) and quant.keys (the quantization keys' checks)."""

import datetime
import enum

import pytest

from bdlora_train.core.errors import BlockDiagLoraError, RecipeError
from bdlora_train.quant.keys import BNB_4BIT, BNB_8BIT, QUANT_TYPES, SWITCHES, TORCHAO_INT8, QuantKeys
from bdlora_train.recipe.load import load_recipe
from bdlora_train.recipe.text import Text, parse_overrides, read_recipe_file, typed_value


def _refused(call, *parts):
    with pytest.raises(RecipeError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, (part, message)
    assert isinstance(info.value, BlockDiagLoraError)
    return message


# ------------------------------------------------------------------------------------ typed_value: override text


@pytest.mark.parametrize(
    "raw, hint, expected",
    [
        ("40", int, 40),
        (" 40 ", int, 40),
        ("1e-3", float, 0.001),
        ("3", float, 3.0),
        ("yes", bool, True),
        ("OFF", bool, False),
        ("0", bool, False),
        ("Question: {q}", str, "Question: {q}"),  # YAML would read a mapping
        ("yes", str, "yes"),  # YAML 1.1 would read a bool
        ("a\\nb\\tc\\\\d", str, "a\nb\tc\\d"),  # \n, \t, \\ escapes
        ("null", str | None, None),
        ("~", int | None, None),
        ("", str | None, None),
        ("7", int | None, 7),
        ("q_proj, v_proj,", list[str], ["q_proj", "v_proj"]),
        ("[q_proj, v_proj]", list[str] | None, ["q_proj", "v_proj"]),
        ("{a: 1, b: [2]}", dict, {"a": 1, "b": [2]}),
        ("true", bool | str | None, True),  # resume_from_checkpoint=true
        ("runs/x/checkpoint-10", bool | str | None, "runs/x/checkpoint-10"),
        ("auto", float | str, "auto"),  # bd_lr_ratio=auto
        ("2", float | str, 2.0),
    ],
)
def test_override_text_is_parsed_by_the_field_type(raw, hint, expected):
    value = typed_value("key", Text(raw), hint)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    "raw, hint, part",
    [
        ("4x", int, "max_steps='4x' is not an integer"),
        ("fast", float, "max_steps='fast' is not a number"),
        ("maybe", bool, "max_steps='maybe' is not a bool; use true or false"),
        ("fast", int | None, "max_steps='fast' is not an integer (or null)"),
        ("{a: [1", dict, "max_steps='{a: [1' is not valid YAML/JSON"),
    ],
)
def test_override_text_that_is_not_the_field_type_is_refused(raw, hint, part):
    _refused(lambda: typed_value("max_steps", Text(raw), hint), part)


# ---------------------------------------------------------------------------------------- typed_value: YAML values


class Colour(enum.Enum):
    RED = "red"


@pytest.mark.parametrize(
    "value, hint, expected",
    [
        (3, float, 3.0),
        ("1e-5", float, 1e-5),  # YAML 1.1 reads 1e-5 as a string
        (5, str, "5"),
        (datetime.date(2024, 1, 2), str, "2024-01-02"),  # YAML 1.1 reads 2024-01-02 as a date
        ("a,b", list[str], ["a", "b"]),
        (("a", 1), list, ["a", 1]),
        (None, int | None, None),
        (True, bool | str | None, True),  # a YAML bool stays a bool
        ("red", Colour, "red"),
        (Colour.RED, Colour, "red"),
        ({"x": 1}, object, {"x": 1}),
    ],
)
def test_yaml_values_are_coerced_to_the_field_type(value, hint, expected):
    coerced = typed_value("key", value, hint)
    assert coerced == expected and type(coerced) is type(expected)


@pytest.mark.parametrize(
    "value, hint, part",
    [
        (True, int, "key=True is not an integer"),  # a bool is not an integer here
        (1, bool, "key=1 is not a bool; use true or false"),
        (True, float, "key=True is not a number"),
        ([1], str, "key=[1] is not a string; quote it"),
        ({"a": 1}, list, "key={'a': 1} is not a list"),
        ([1], dict, "key=[1] is not a mapping"),
        (None, int, "key cannot be null; give an integer"),
        ("blue", Colour, "key='blue'; use one of ['red']"),
        ("x", set, "key has an unsupported type"),
    ],
)
def test_yaml_values_of_another_type_are_refused(value, hint, part):
    _refused(lambda: typed_value("key", value, hint), f"recipe: {part}")


# --------------------------------------------------------------------------------------------- parse_overrides


def test_parse_overrides_splits_at_the_first_equals_sign():
    assert parse_overrides(["max_steps=40", " run_name =a=b", "hub_model_id="]) == {
        "max_steps": "40",
        "run_name": "a=b",
        "hub_model_id": "",
    }
    assert parse_overrides([]) == {}


def test_parse_overrides_refuses_an_item_without_equals():
    _refused(lambda: parse_overrides(["max_steps"]), "'max_steps' is not key=value (e.g. max_steps=40)")


def test_parse_overrides_refuses_a_key_given_twice():
    _refused(lambda: parse_overrides(["lora_r=4", "lora_r=8"]), "'lora_r' is given twice ('4' and '8'); keep one")


# ------------------------------------------------------------------------------------------- read_recipe_file


def test_read_recipe_file_reads_exponents_as_floats(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("learning_rate: 1e-5\nwarmup_ratio: 2.5E+1\nmax_steps: 10\nrun_name: yes\n")
    assert read_recipe_file(path) == {"learning_rate": 1e-5, "warmup_ratio": 25.0, "max_steps": 10, "run_name": True}


def test_read_recipe_file_of_an_empty_file_is_empty(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert read_recipe_file(path) == {}


def test_read_recipe_file_refuses_a_repeated_key_with_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("lora_r: 4\nmax_steps: 2\nlora_r: 8\n")
    _refused(lambda: read_recipe_file(path), f"recipe {path}: key 'lora_r' appears twice (lines 1 and 3); keep one")


def test_read_recipe_file_refuses_a_repeated_key_in_a_nested_mapping(tmp_path):
    path = tmp_path / "nested.yaml"
    path.write_text("training_args:\n  a: 1\n  a: 2\n")
    _refused(lambda: read_recipe_file(path), "key 'a' appears twice (lines 2 and 3)")


def test_read_recipe_file_refuses_a_missing_file(tmp_path):
    _refused(lambda: read_recipe_file(tmp_path / "nope.yaml"), "nope.yaml: file not found", "recipes/tiny/bdlora.yaml")


def test_read_recipe_file_refuses_invalid_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("a: [1, 2\n")
    _refused(lambda: read_recipe_file(path), f"recipe {path}: invalid YAML (")


def test_read_recipe_file_refuses_a_top_level_list(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    _refused(lambda: read_recipe_file(path), "top level must be a mapping of key: value")


# ------------------------------------------------------------------------------------------------- quant.keys


def test_quant_keys_of_a_float_base():
    keys = QuantKeys()
    assert keys.kind is None and keys.switches_on == []
    assert keys.check() is keys


@pytest.mark.parametrize(
    "switch, kind", [("load_in_4bit", BNB_4BIT), ("load_in_8bit", BNB_8BIT), ("torchao_int8", TORCHAO_INT8)]
)
def test_quant_keys_kind_of_each_switch(switch, kind):
    keys = QuantKeys(**{switch: True})
    assert keys.kind == kind and keys.switches_on == [switch]
    assert keys.check() is keys


def test_quant_keys_names():
    assert (BNB_4BIT, BNB_8BIT, TORCHAO_INT8) == ("bitsandbytes-4bit", "bitsandbytes-8bit", "torchao-int8")
    assert set(SWITCHES) == {"load_in_4bit", "load_in_8bit", "torchao_int8"} and QUANT_TYPES == ("nf4", "fp4")


def test_a_recipes_quant_keys_are_exactly_its_quantization_keys():
    recipe = load_recipe(
        None,
        ["model=tiny:llama", "load_in_4bit=true", "bnb_4bit_quant_type=fp4", "bnb_4bit_compute_dtype=bfloat16",
         "bnb_4bit_use_double_quant=true", "torch_dtype=bfloat16", "lora_r=8"],
    )
    keys = recipe.quant_keys
    assert keys == QuantKeys(True, False, False, "fp4", "bfloat16", True, "bfloat16")
    assert keys.check().kind == BNB_4BIT
    assert load_recipe(None, ["model=tiny:llama"]).quant_keys == QuantKeys()  # a float base: every switch off


def test_quant_keys_full_4bit_setup_passes():
    QuantKeys(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype="float16").check()


def test_quant_keys_refuse_two_switches():
    keys = QuantKeys(load_in_4bit=True, torchao_int8=True)
    _refused(keys.check, "recipe: load_in_4bit=true and torchao_int8=true; a base is quantized one way, pick one")


def test_quant_keys_refuse_an_unknown_quant_type():
    _refused(QuantKeys(load_in_4bit=True, bnb_4bit_quant_type="int4").check, "bnb_4bit_quant_type='int4'", "nf4")


def test_quant_keys_refuse_an_unknown_compute_dtype():
    keys = QuantKeys(load_in_4bit=True, bnb_4bit_compute_dtype="int8")
    _refused(keys.check, "bnb_4bit_compute_dtype='int8'; use float32, bfloat16, float16 or null")


@pytest.mark.parametrize(
    "extra",
    [dict(bnb_4bit_use_double_quant=True), dict(bnb_4bit_compute_dtype="float32"), dict(bnb_4bit_quant_type="fp4")],
)
def test_quant_keys_refuse_4bit_options_without_4bit(extra):
    keys = QuantKeys(load_in_8bit=True, **extra)
    _refused(keys.check, "bnb_4bit_* keys apply to load_in_4bit=true only; set it or drop them")
