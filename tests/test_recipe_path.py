"""How far the recipe travels from ``pipeline.run`` (scripts/recipe_path.py, issue 81): the count on a
made-up package, and this package's held at today's figure so a new stop is a decision, not a drift."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("recipe_path", ROOT / "scripts" / "recipe_path.py")
recipe_path = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe_path)

# scripts/recipe_path.py on main, 2026-12-06 (53 stops in 26 files at e7c3b55, by the same count; 54 in 26
# once the house's round seven landed; 55 in 28 with dbrx's flat experts packed from the quant section,
# moe_flat.pack_flat_experts, and the experts' packing moved to model/expert_stacks.py; 47 in 22 once the
# functions that read one to three fields take those values: the experts' packing its compute dtype, 4-bit
# type and double quantization, mxfp4 its revision and trust_remote_code, images.packing_refusal the vision
# facet and kernel name, rewards.check_importable the rewards' names)
MOST_STOPS, MOST_FILES = 47, 22


def test_a_stop_is_a_function_handed_the_recipe_or_a_section_not_a_value(tmp_path):
    files = {
        "recipe/sections.py": "class Recipe(Section):\n    data: DataSection = DataSection()\n",
        "training/pipeline.py": (
            "from qlora_kit.data import prepare\nfrom qlora_kit.data.prepare import tokenize\n"
            "def run(recipe):\n    data = recipe.data\n    prepare.rows(data)\n    tokenize(recipe.train.seed)\n"
            "    _build(recipe)\n"
            "def _build(r):\n    prepare.Reader(r.data)\n"
        ),
        "data/prepare.py": (
            "def rows(section):\n    pass\ndef tokenize(seed):\n    pass\n"
            "class Reader:\n    def __init__(self, section):\n        pass\n"
        ),
    }
    for name, text in files.items():
        (tmp_path / "qlora_kit" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "qlora_kit" / name).write_text(text)
    stops, modules, climbs, found, _ = recipe_path.count(tmp_path)
    assert found == {
        ("qlora_kit.training.pipeline", "run"),
        ("qlora_kit.training.pipeline", "_build"),
        ("qlora_kit.data.prepare", "rows"),  # a section, through a local name
        ("qlora_kit.data.prepare", "Reader.__init__"),  # a class's constructor
    }  # tokenize gets a value of the recipe, not the recipe
    assert (stops, modules, climbs) == (4, 2, 0)


def test_the_recipe_makes_no_more_stops_than_today():
    stops, modules, climbs, _, _ = recipe_path.count(ROOT)
    assert stops <= MOST_STOPS and modules <= MOST_FILES and climbs == 0, (stops, modules, climbs)
