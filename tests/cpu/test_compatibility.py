"""The one table of features that do not combine yet (controller/compatibility.py): every refused
pair is refused by the start's checks with its line, built from the two features' own example
settings; docs/compatibility.md prints the table as the code has it."""

from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.controller.compatibility import FEATURES, REFUSED, markdown, refused_pairs
from hybridflow.controller.setup import check_config
from hybridflow.errors import UserError


@pytest.mark.parametrize("pair", list(REFUSED), ids=lambda p: "+".join(p))
def test_every_refused_pair_is_refused_with_its_line(pair):
    a, b = pair
    config = load_config(None, [*FEATURES[a].example, *FEATURES[b].example])
    workers = config.resources.num_workers
    assert refused_pairs(config, workers)[0] == pair  # the first one it holds: its own line is said
    with pytest.raises(
        UserError, match=f"{FEATURES[a].shown(config)} with {FEATURES[b].shown(config)}: "
    ) as e:
        check_config(config, workers)
    assert REFUSED[pair] in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", list(FEATURES))
def test_every_feature_alone_is_accepted(name):
    config = load_config(None, list(FEATURES[name].example))
    assert refused_pairs(config, config.resources.num_workers) == []


def test_the_docs_page_is_the_table():
    page = (Path(__file__).parents[2] / "docs" / "compatibility.md").read_text()
    assert markdown() in page, (
        "docs/compatibility.md's tables are not compatibility.markdown() as rendered now"
    )
