"""Prompt sets (experiments/sources/prompt_sets.py): every format from files written here, auto detection,
slicing, the errors, from_config, and the module's doctests."""

import doctest
import json
import random

import pytest

from tomerge.experiments.sources import prompt_sets
from tomerge.experiments.sources.prompt_sets import PromptSet, read_prompts


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


# -- formats ---------------------------------------------------------------------------------------

def test_txt_strips_skips_blank_lines_and_keeps_hash(tmp_path):
    f = write(tmp_path / "p.txt", "  a red cube  \n\n\t\na corgi # not a comment\n# a hash first\nlast")
    assert read_prompts(f) == ["a red cube", "a corgi # not a comment", "# a hash first", "last"]
    assert read_prompts(f, format="txt") == read_prompts(str(f))


def test_jsonl_prompt_then_caption_then_explicit_field(tmp_path):
    lines = [json.dumps({"prompt": " a fox ", "caption": "ignored"}), "", json.dumps({"caption": "a boat"}),
             json.dumps({"prompt": "a cat", "text": "a dog"})]
    f = write(tmp_path / "p.jsonl", "\n".join(lines) + "\n\n")
    assert read_prompts(f) == ["a fox", "a boat", "a cat"]
    g = write(tmp_path / "q.jsonl", json.dumps({"text": "one", "prompt": "x"}) + "\n" + json.dumps({"text": "two"}))
    assert read_prompts(g, field="text") == ["one", "two"]
    assert PromptSet(str(g), field="text").prompts() == ["one", "two"]


def make_coco(rng):
    """Images 30, 10, 20 (listed out of order), 2-4 captions each, annotations shuffled; returns the
    file content and the expected prompts by the documented rule."""
    captions = {  # image_id -> [(annotation id, caption)]; the smallest id is listed second on purpose
        30: [(305, "Thirty, later."), (301, "  A  train\nat the\tstation. "), (399, "Thirty, last.")],
        10: [(150, "Ten, later."), (104, "A dog on a sofa."), (900, "Ten, much later."), (120, "Ten, mid.")],
        20: [(220, "Twenty, later."), (7, "a cat\n\nwith a hat")],
    }
    annotations = [{"image_id": img, "id": ann_id, "caption": cap}
                   for img, caps in captions.items() for ann_id, cap in caps]
    rng.shuffle(annotations)
    images = [{"id": i, "file_name": f"{i:012d}.jpg"} for i in (30, 10, 20, 40)]  # 40 has no caption
    expected = ["A dog on a sofa.", "a cat with a hat", "A train at the station."]  # image ids 10, 20, 30
    return {"info": {}, "images": images, "annotations": annotations}, expected


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_coco_one_caption_per_image_smallest_annotation_id_in_image_id_order(tmp_path, seed):
    data, expected = make_coco(random.Random(seed))
    f = write(tmp_path / "captions_val2017.json", json.dumps(data))
    assert read_prompts(f) == expected
    assert read_prompts(f, format="coco") == expected
    assert PromptSet(str(f), num_prompts=2, prompt_offset=1).prompts() == expected[1:3]


def test_coco_longest_caption_rule_of_the_sdtm_sampler(tmp_path):
    annotations = [{"image_id": 2, "id": 1, "caption": "short"},
                   {"image_id": 2, "id": 5, "caption": "the longest caption of image two"},
                   {"image_id": 2, "id": 3, "caption": "a middling caption"},
                   {"image_id": 1, "id": 9, "caption": "tie aaaa"},  # equal lengths: the smaller id wins
                   {"image_id": 1, "id": 8, "caption": "tie bbbb"},
                   {"image_id": 1, "id": 2, "caption": "tiny"}]
    f = write(tmp_path / "captions.json", json.dumps({"annotations": annotations}))
    assert read_prompts(f, coco_caption="longest") == ["tie bbbb", "the longest caption of image two"]
    assert read_prompts(f) == ["tiny", "short"]  # the default rule: smallest annotation id
    assert PromptSet(str(f), coco_caption="longest").prompts() == ["tie bbbb", "the longest caption of image two"]
    with pytest.raises(ValueError, match="coco_caption"):
        PromptSet(str(f), coco_caption="random")


def test_parti_tsv_prompt_column_with_extra_columns_commas_hashes_and_quotes(tmp_path):
    rows = ["Prompt\tCategory\tChallenge\tNote",
            "bond\tAbstract\tBasic\tBiology-inspired concepts with multiple meanings",
            "A dignified beaver wearing glasses, a vest, and a #1 tie.\tAnimals\tComplex\t",
            '"G I G G L E" painted in thick lettering\tIllustrations\tWriting & Symbols\t',
            "",
            "a portrait flying over the city of Mars. \tWorld Knowledge\tComplex\t"]
    f = write(tmp_path / "PartiPrompts.tsv", "\n".join(rows) + "\n")
    expected = ["bond", "A dignified beaver wearing glasses, a vest, and a #1 tie.",
                '"G I G G L E" painted in thick lettering', "a portrait flying over the city of Mars."]
    assert read_prompts(f) == expected
    # the Prompt column need not be first
    g = write(tmp_path / "other.tsv", "Category\tPrompt\nArts\ta, b # c\nAnimals\ta shiba inu\n")
    assert read_prompts(g, format="parti") == ["a, b # c", "a shiba inu"]


def test_classes_from_text_json_list_and_both_imagenet_index_shapes(tmp_path):
    t = write(tmp_path / "names.txt", "tench\n\ngreat_white_shark\n  goldfish \n")
    assert read_prompts(t, format="classes") == ["a photo of a tench", "a photo of a great white shark",
                                                 "a photo of a goldfish"]
    lst = write(tmp_path / "names.json", json.dumps(["tiger_cat", "toucan"]))
    assert read_prompts(lst, template="an image of a {name}, high quality") == [
        "an image of a tiger cat, high quality", "an image of a toucan, high quality"]
    # keys out of order and past 9: ordered by integer, not by string ("10" < "2" as strings)
    index = {"10": ["n01530575", "brambling"], "2": ["n01484850", "great_white_shark"], "0": ["n01440764", "tench"]}
    f = write(tmp_path / "imagenet_class_index.json", json.dumps(index))
    assert read_prompts(f) == ["a photo of a tench", "a photo of a great white shark", "a photo of a brambling"]
    names = {"1": "goldfish, Carassius auratus", "0": "tench, Tinca tinca", "2": "great white shark, white shark"}
    g = write(tmp_path / "imagenet1000_clsidx.json", json.dumps(names))
    assert read_prompts(g, format="classes", template="{name}") == ["tench", "goldfish", "great white shark"]


def test_auto_detection_by_extension_and_json_content(tmp_path):
    same = "a b c"
    cases = {
        "x.txt": (same, same),
        "x.jsonl": (json.dumps({"prompt": same}), same),
        "x.tsv": (f"Prompt\tNote\n{same}\tn", same),
        "x.json": (json.dumps({"annotations": [{"image_id": 1, "id": 1, "caption": same}]}), same),
        "y.json": (json.dumps([same]), f"a photo of a {same}"),
        "z.json": (json.dumps({"0": ["n0", same]}), f"a photo of a {same}"),
        "UPPER.TXT": (same, same),
    }
    for name, (text, expected) in cases.items():
        assert read_prompts(write(tmp_path / name, text)) == [expected], name
    # an explicit format wins over the extension
    assert read_prompts(write(tmp_path / "lines.csv", "a\nb"), format="txt") == ["a", "b"]


# -- slicing and the dataclass ---------------------------------------------------------------------

def test_offset_and_num_prompts_slice_and_images_per_prompt_is_only_recorded(tmp_path):
    f = write(tmp_path / "p.txt", "\n".join(f"prompt {i}" for i in range(10)))
    everything = [f"prompt {i}" for i in range(10)]
    assert PromptSet(str(f)).prompts() == everything
    assert PromptSet(str(f), num_prompts=3).prompts() == everything[:3]
    assert PromptSet(str(f), prompt_offset=4).prompts() == everything[4:]
    assert PromptSet(str(f), prompt_offset=4, num_prompts=2).prompts() == ["prompt 4", "prompt 5"]
    assert PromptSet(str(f), prompt_offset=8, num_prompts=5).prompts() == ["prompt 8", "prompt 9"]
    assert PromptSet(str(f), prompt_offset=8, num_prompts=5).read() == everything
    assert PromptSet(str(f), images_per_prompt=4).prompts() == everything
    with pytest.raises(ValueError, match="prompt_offset=10 leaves no prompts.*has 10"):
        PromptSet(str(f), prompt_offset=10).prompts()


@pytest.mark.parametrize("kwargs, match", [
    ({"num_prompts": 0}, "num_prompts must be an integer >= 1"),
    ({"num_prompts": 2.5}, "num_prompts must be an integer >= 1"),
    ({"prompt_offset": -1}, "prompt_offset must be an integer >= 0"),
    ({"images_per_prompt": 0}, "images_per_prompt must be an integer >= 1"),
    ({"format": "csv"}, r"unknown prompt format 'csv'; valid formats: \['auto', 'txt'"),
    ({"template": "a photo of a {}"}, "template must contain {name}"),
    ({"template": "a {name} in {place}"}, "can only use {name}"),
    ({"file": ""}, "file must be a non-empty path"),
])
def test_invalid_fields_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PromptSet(**{"file": "p.txt", **kwargs})


def test_from_config_string_dict_overrides_none_and_unknown_keys(tmp_path):
    f = write(tmp_path / "p.txt", "a\nb\nc")
    assert PromptSet.from_config(None) is None
    assert PromptSet.from_config(str(f)) == PromptSet(file=str(f))
    assert PromptSet.from_config(f).file == str(f)  # a Path becomes its string
    ps = PromptSet.from_config({"file": str(f), "num_prompts": 1, "prompt_offset": 1, "images_per_prompt": 3})
    assert (ps.prompts(), ps.images_per_prompt) == (["b"], 3)
    assert PromptSet.from_config(str(f), prompt_offset=2).prompts() == ["c"]
    assert PromptSet.from_config({"file": str(f), "num_prompts": 1}, num_prompts=2).num_prompts == 2
    assert PromptSet.from_config(ps.to_dict()) == ps
    assert ps.to_dict() == {"file": str(f), "format": "auto", "field": None, "template": "a photo of a {name}",
                            "num_prompts": 1, "prompt_offset": 1, "images_per_prompt": 3, "coco_caption": "first",
                            "image_field": None}
    with pytest.raises(ValueError, match=r"unknown prompts key\(s\) \['count'\]; valid keys: \['file', 'format'"):
        PromptSet.from_config({"file": str(f), "count": 3})
    with pytest.raises(ValueError, match=r"unknown prompts key\(s\) \['seed'\]"):
        PromptSet.from_config(str(f), seed=1)
    with pytest.raises(ValueError, match="a mapping needs 'file'"):
        PromptSet.from_config({"num_prompts": 3})
    with pytest.raises(TypeError, match="expected a file path or a mapping"):
        PromptSet.from_config(3)


# -- errors ----------------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompt file not found: .*nope.txt"):
        read_prompts(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        PromptSet(str(tmp_path / "nope.json")).prompts()


@pytest.mark.parametrize("name, text, fmt", [
    ("empty.txt", "", "auto"),
    ("blank.txt", "\n  \n\t\n", "auto"),
    ("blank.jsonl", "\n\n", "auto"),
    ("header_only.tsv", "Prompt\tCategory\n", "auto"),
    ("no_annotations_left.json", json.dumps({"images": [], "annotations": []}), "auto"),
    ("empty_list.json", "[]", "auto"),
    ("blank_names.txt", "\n\n", "classes"),
])
def test_a_file_with_no_prompts(tmp_path, name, text, fmt):
    with pytest.raises(ValueError, match="no prompts in .*" + name.replace(".", r"\.")):
        read_prompts(write(tmp_path / name, text), format=fmt)


def test_jsonl_errors_name_the_line(tmp_path):
    f = write(tmp_path / "p.jsonl", "\n".join([json.dumps({"prompt": "ok"}), "", json.dumps({"text": "x"})]))
    with pytest.raises(ValueError, match=r"line 3 of .*p\.jsonl has neither a 'prompt' nor a 'caption' field"):
        read_prompts(f)
    g = write(tmp_path / "q.jsonl", json.dumps({"text": "x"}) + "\n" + json.dumps({"prompt": "y"}))
    with pytest.raises(ValueError, match=r"line 2 of .*q\.jsonl has no 'text' field"):
        read_prompts(g, field="text")
    h = write(tmp_path / "r.jsonl", json.dumps({"prompt": "x"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"line 2 of .*r\.jsonl is not valid JSON"):
        read_prompts(h)
    k = write(tmp_path / "s.jsonl", json.dumps({"prompt": 3}))
    with pytest.raises(ValueError, match=r"line 1 of .*'prompt' must be a non-empty string"):
        read_prompts(k)


def test_tsv_without_prompt_column(tmp_path):
    f = write(tmp_path / "p.tsv", "prompt text\tCategory\na cat\tAnimals\n")
    with pytest.raises(ValueError, match=r"no 'Prompt' column.*\['prompt text', 'Category'\]"):
        read_prompts(f)
    with pytest.raises(ValueError, match="no 'Prompt' column"):  # a comma-separated file read as parti
        read_prompts(write(tmp_path / "c.csv", "Prompt,Category\na cat,Animals\n"), format="parti")


def test_coco_json_without_annotations(tmp_path):
    f = write(tmp_path / "c.json", json.dumps({"images": [{"id": 1}], "captions": []}))
    with pytest.raises(ValueError, match="not a COCO captions JSON: it has no 'annotations'"):
        read_prompts(f, format="coco")
    with pytest.raises(ValueError, match=r"no 'annotations'.*set format:"):  # auto can tell neither
        read_prompts(f)
    g = write(tmp_path / "d.json", json.dumps({"annotations": [{"image_id": 1, "caption": "no id"}]}))
    with pytest.raises(ValueError, match="annotation 0 needs 'image_id', 'id' and 'caption'"):
        read_prompts(g)


def test_template_without_name(tmp_path):
    f = write(tmp_path / "names.txt", "tench\n")
    with pytest.raises(ValueError, match=r"template must contain \{name\}"):
        read_prompts(f, format="classes", template="a photo of a {}")
    with pytest.raises(ValueError, match=r"template must contain \{name\}"):
        PromptSet(str(f), format="classes", template="a photo")


def test_unknown_format_and_unknown_extension(tmp_path):
    f = write(tmp_path / "p.csv", "a\n")
    with pytest.raises(ValueError, match="unknown prompt format 'yaml'"):
        read_prompts(f, format="yaml")
    with pytest.raises(ValueError, match=r"cannot tell the prompt format of .*p\.csv.*'\.csv'.*set format:"):
        read_prompts(f)
    with pytest.raises(ValueError, match="cannot tell the prompt format.*'\\(none\\)'"):
        read_prompts(write(tmp_path / "prompts", "a\n"))
    with pytest.raises(ValueError, match="not valid JSON"):
        read_prompts(write(tmp_path / "bad.json", "{"))


def test_doctests_of_the_module_pass():
    result = doctest.testmod(prompt_sets, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 8 and result.failed == 0
