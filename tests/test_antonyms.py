"""The learning demo's task (envs/antonyms.py): its reward rule, its two splits, and the env
served by the example env server like the other bundled envs."""

from __future__ import annotations

import pytest
import requests

from envs import antonyms
from envs.base import EnvError
from envs.bundled import Antonym


@pytest.mark.unit
def test_the_reward_reads_the_first_line_for_an_accepted_antonym():
    assert antonyms.reward("hot", 'The opposite of "hot" is "cold".') == 1.0
    assert antonyms.reward("hot", "Cold") == 1.0
    assert antonyms.reward("big", "little.") == 1.0  # any accepted answer
    assert antonyms.reward("hot", "Warm.\nOr cold.") == 0.0  # the first line only
    assert antonyms.reward("hot", "coldness") == 0.0  # a word, not a substring
    assert antonyms.reward("hot", " ".join(["maybe"] * 12) + " cold") == 0.0  # longer than MAX_WORDS
    assert antonyms.reward("hot", "") == 0.0


@pytest.mark.unit
def test_the_splits_share_no_word_and_words_naming_each_other_stay_together():
    train, heldout = antonyms.split("train"), antonyms.split("heldout")
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == sorted(antonyms.ANSWERS)
    assert 30 <= len(heldout) <= len(train)
    for word, accepted in antonyms.ANSWERS.items():
        for a in accepted:
            if a in antonyms.ANSWERS:  # a prompt word names another: same split
                assert (word in heldout) == (a in heldout), (word, a)
    assert antonyms.split("heldout") == heldout  # fixed, not drawn anew
    with pytest.raises(ValueError):
        antonyms.split("test")


@pytest.mark.unit
def test_the_env_class_plays_one_turn():
    env = Antonym()
    env.reset({"dataset": {"word": "hot"}}, seed=1)
    (msg,) = env.get_task_prompt()
    assert msg["role"] == "user" and '"hot"' in msg["content"]
    out = env.step("Cold.")
    assert out["reward"] == 1.0 and out["terminated"] and env.get_task_prompt() == []
    with pytest.raises(EnvError):
        env.reset({"dataset": {"word": "not-in-the-table"}}, seed=1)


def test_the_example_env_server_serves_it(env_server):
    _, url = env_server
    assert "antonym" in requests.get(f"{url}/envs", timeout=5).json()
    assert requests.post(f"{url}/antonym/e1/reset", json={"env_param": {"dataset": {"word": "up"}}, "seed": 0},
                         timeout=5).status_code == 200
    assert requests.get(f"{url}/antonym/e1/get_task_prompt", timeout=5).json()[0]["content"].count('"up"') == 1
    step = requests.post(f"{url}/antonym/e1/step", json={"action": "down"}, timeout=5).json()
    assert step["reward"] == 1.0 and step["terminated"]


@pytest.mark.unit
def test_the_learning_demos_task_files_give_every_word_back_as_written(tmp_path):
    """YAML reads a bare on, yes or true as a boolean (three train words), which the env refuses:
    every row of both task files must reach the env as the split's word."""
    from examples.learn.task_files import write
    from producer.yamlfile import load_yaml

    for path, name in zip(write(tmp_path, "http://127.0.0.1:1", train_group=1, heldout_samples=1),
                          ("train", "heldout")):
        (entry,) = load_yaml(str(path))[0]["environments"]
        assert [row["word"] for row in entry["dataset"]] == antonyms.split(name)
