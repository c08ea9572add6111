"""``antonym`` (single-turn): "What is the opposite of "hot"? Answer with one word." The reward is
1 when the first line of the answer, at most :data:`MAX_WORDS` words, holds an accepted antonym
as a word ("The opposite of "hot" is "cold"." earns it), else 0.

The task the learning demo trains on (examples/learn/): SmolLM2-135M-Instruct answers right
about 0.8 of the time greedily but, sampled at temperature 1 with nothing cut off, only about
0.2 of the time, so GRPO has groups with something to compare and room to rise.

The prompt words come in two splits that share no word (:func:`split`): ``train``, which the
trainer samples from, and ``heldout``, on which it is evaluated; words that name each other (hot,
cold; old, new, young) are always in the same split. A task names its word as a dataset row
``{"word": "hot"}`` (or ``env_params: {word: hot}``); the accepted answers come from the table
here, so a task file cannot change the reward.
"""

from __future__ import annotations

import random
import re

from envs.base import EnvError

# "word:accepted,accepted" — the accepted antonyms of each prompt word.
_TABLE = """
hot:cold big:small,little up:down fast:slow happy:sad,unhappy open:closed,shut light:dark,heavy old:new,young
rich:poor wet:dry early:late strong:weak hard:soft,easy full:empty high:low long:short good:bad,evil
black:white day:night left:right top:bottom in:out yes:no win:lose,loss love:hate buy:sell
push:pull start:end,finish,stop first:last inside:outside above:below,beneath before:after come:go give:take
friend:enemy,foe question:answer true:false,untrue thick:thin clean:dirty tall:short wide:narrow deep:shallow
loud:quiet,soft cheap:expensive,costly safe:dangerous,unsafe sweet:sour,bitter,salty alive:dead sharp:dull,blunt
north:south east:west summer:winter morning:evening,night boy:girl man:woman king:queen brother:sister
father:mother husband:wife noisy:quiet,silent smooth:rough brave:cowardly,afraid,scared,coward laugh:cry
remember:forget accept:reject,refuse arrive:leave,depart borrow:lend asleep:awake always:never
entrance:exit increase:decrease,reduce inhale:exhale maximum:minimum near:far on:off over:under
positive:negative private:public rise:fall,set,sink sick:healthy,well,fine sunny:cloudy,rainy
success:failure,fail victory:defeat war:peace wild:tame,domestic young:old heaven:hell import:export
join:separate,leave,split lazy:hardworking,active,busy,diligent minor:major more:less,fewer most:least
ancient:modern attack:defend,defense best:worst bright:dark,dim,dull
calm:angry,stormy,nervous,agitated careful:careless correct:incorrect,wrong,false
cruel:kind,gentle,nice,compassionate difficult:easy fat:thin,skinny fresh:stale,rotten,old
friendly:unfriendly,hostile,mean generous:stingy,selfish,greedy guilty:innocent hungry:full,satisfied
inner:outer input:output junior:senior lead:follow lost:found,won melt:freeze,solidify mix:separate
noon:midnight odd:even optimist:pessimist partial:complete,whole,full patient:impatient polite:rude,impolite
present:absent,past raw:cooked rear:front receive:give,send simple:complex,complicated,difficult
sour:sweet spend:save,earn tight:loose,slack ugly:beautiful,pretty,handsome vertical:horizontal
visible:invisible,hidden whisper:shout,yell wise:foolish,stupid,unwise,dumb
"""

ANSWERS: dict[str, tuple[str, ...]] = {}
for _item in _TABLE.split():
    _word, _accepted = _item.split(":")
    if _word in ANSWERS:
        raise AssertionError(f"antonym table: {_word!r} twice")
    ANSWERS[_word] = tuple(_accepted.split(","))

MAX_WORDS = 12  # a first line longer than this earns nothing (a list of guesses is not an answer)
SPLIT_SEED = 37
HELDOUT_SHARE = 1 / 3
_WORD = re.compile(r"[a-z]+")


def _components() -> list[list[str]]:
    """Prompt words joined when one names the other (as prompt or answer), sorted."""
    parent = {w: w for w in ANSWERS}

    def root(w: str) -> str:
        while parent[w] != w:
            parent[w] = parent[parent[w]]
            w = parent[w]
        return w

    for w, accepted in ANSWERS.items():
        for a in accepted:
            if a in parent:
                parent[root(a)] = root(w)
    groups: dict[str, list[str]] = {}
    for w in ANSWERS:
        groups.setdefault(root(w), []).append(w)
    return sorted(sorted(g) for g in groups.values())


def split(name: str) -> list[str]:
    """The prompt words of ``train`` or ``heldout``: a fixed draw over groups of words that name
    each other, so that no held-out word is trained on as a prompt or as an answer's prompt."""
    if name not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {name!r}")
    groups = _components()
    random.Random(SPLIT_SEED).shuffle(groups)
    want = round(len(ANSWERS) * HELDOUT_SHARE)
    heldout: list[str] = []
    train: list[str] = []
    for g in groups:
        (heldout if len(heldout) + len(g) <= want else train).extend(g)
    return sorted(heldout if name == "heldout" else train)


def reward(word: str, answer: str) -> float:
    """1.0 when the answer's first line (at most MAX_WORDS words) holds an accepted antonym."""
    first = answer.strip().split("\n", 1)[0].lower()
    words = _WORD.findall(first)
    return 1.0 if len(words) <= MAX_WORDS and any(a in words for a in ANSWERS[word]) else 0.0


def question(word: str) -> str:
    return f'What is the opposite of "{word}"? Answer with one word.'


class AntonymEnv:
    """Single-turn: one word's antonym; the word from the dataset row or env_params ``word``."""

    name = "antonym"

    def __init__(self, env_param: dict, seed: int | None):  # noqa: ARG002 - the word decides
        row = env_param.get("dataset")
        word = (row.get("word") if isinstance(row, dict) else None) or env_param.get("word")
        if not isinstance(word, str) or word not in ANSWERS:
            raise EnvError(f"antonym needs a 'word' (dataset row or env_param) from envs/antonyms.py's table, "
                           f"got {word!r}")
        self.word = word
        self.done = False
        self.history = [{"role": "user", "content": question(word)}]

    def reset_answer(self) -> dict:
        return {"observation": {"word": self.word}, "info": {}}

    def prompt(self) -> list[dict]:
        return [] if self.done else list(self.history)

    def step(self, action: str) -> dict:
        if self.done:
            raise EnvError("the episode is over; reset the instance first")
        self.done = True
        r = reward(self.word, action)
        return {"observation": {"correct": r > 0}, "reward": r, "terminated": True, "truncated": False,
                "info": {"correct": r > 0, "accepted": list(ANSWERS[self.word])}}
