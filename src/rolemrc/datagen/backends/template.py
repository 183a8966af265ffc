"""The offline `template` backend: profiles and stylised replies composed from the profile itself.

Deterministic given the run seed and each item's key. A profile's speech style is one of STYLES;
its replies reuse that style's openers, closers and (where narration is allowed) bracketed actions,
so the style is consistent within a role and differs between roles.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from rolemrc.datagen.replies import ReplySpec, Rule
from rolemrc.datagen.seeding import rng_for


@dataclass(frozen=True)
class Style:
    description: str
    openers: tuple[str, ...]
    closers: tuple[str, ...]
    actions: tuple[str, ...]


STYLES: tuple[Style, ...] = (
    Style("Warm and unhurried, with homely comparisons and a gentle sense of humour.",
          ("Ah, come and sit a moment.", "Well now, let me see.", "Oh, that is a good one."),
          ("There, I hope that helps.", "Mind how you go.", "Ask me anything else, dear."),
          ("smiles warmly", "pours another cup of tea", "leans back in the old chair")),
    Style("Brisk, precise and practical; short sentences and no wasted words.",
          ("Right.", "Straight to it, then.", "Listen."),
          ("That is all there is to it.", "Next question.", "Good. Moving on."),
          ("taps the table twice", "checks the time", "folds both arms")),
    Style("Lyrical and reflective, fond of images from nature and of quiet pauses.",
          ("Let the words settle first.", "Listen, the way one listens to rain.", "There is a quiet story here."),
          ("Such is the way of things.", "Let that linger a while.", "And so the tide turns."),
          ("gazes out of the window", "traces a slow circle in the air", "pauses with eyes half closed")),
    Style("Bubbly and enthusiastic, quick to exclaim and to encourage.",
          ("Oh, I love this!", "Ooh, great question!", "Yes, let us dive in!"),
          ("Is that not brilliant?", "You have made my day!", "Keep those questions coming!"),
          ("claps both hands together", "bounces on the heels", "grins from ear to ear")),
    Style("Gruff and plain-spoken, with dry humour under a rough surface.",
          ("Hmph. Fine.", "Do not rush me.", "Aye, I heard you."),
          ("Now let me get back to work.", "Do not make me repeat it.", "That is that."),
          ("grunts", "wipes both hands on an old rag", "squints across the table")),
    Style("Measured and scholarly, careful with claims and fond of precise terms.",
          ("Let us consider this carefully.", "An interesting matter.", "Allow me to be precise."),
          ("I trust that is clear.", "One should always check the sources.", "That is the long and short of it."),
          ("adjusts a pair of spectacles", "lays a finger on the page", "clears the throat")),
    Style("A born storyteller who wraps every point in an anecdote.",
          ("That reminds me of something.", "Gather round, this is a good one.", "Picture this."),
          ("And that is how the story goes.", "Remember that one, friend.", "Stories like that stay with you."),
          ("lowers the voice conspiratorially", "spreads both hands wide", "chuckles at the memory")),
    Style("Soft-spoken and a little hesitant, apologising often but careful and kind.",
          ("Oh, um, let me think.", "Sorry, give me a second.", "I hope I get this right."),
          ("I hope that was useful.", "Sorry if that was long.", "Please tell me if I got it wrong."),
          ("fidgets with a sleeve", "looks down shyly", "tucks hair behind an ear")),
)
TRAITS = ("patient", "curious", "stubborn", "generous", "meticulous", "impulsive", "loyal", "sceptical",
          "optimistic", "reserved", "witty", "proud", "gentle", "restless", "honest", "thrifty")
BACKGROUNDS = (
    "Learned the trade from an older mentor and never looked back.",
    "Came to this work late, after trying several other lines of work.",
    "Grew up around this kind of work and took it up naturally.",
    "Trained formally for years before working independently.",
    "Taught themselves most of what they know, through trial and error.",
    "Once left the field for a few years and came back with fresh eyes.",
)
FIRST = ("Mara", "Tomas", "Ines", "Kwame", "Yuki", "Olu", "Freya", "Ravi", "Lucia", "Anders", "Amara", "Jun",
         "Elif", "Mateo", "Noor", "Bram", "Zainab", "Pavel", "Sione", "Hana", "Dmitri", "Aiyana", "Caio", "Leila",
         "Finn", "Ama", "Rosa", "Tariq", "Ingrid", "Kofi", "Mei", "Santiago", "Priya", "Emeka", "Isolde", "Hugo")
LAST = ("Quinn", "Okafor", "Lindqvist", "Tanaka", "Moreau", "Haddad", "Novak", "Mensah", "Castillo", "Brennan",
        "Sato", "Adeyemi", "Kowalski", "Fernandes", "Ibrahim", "Larsen", "Nakamura", "Ortega", "Petrov", "Rahman",
        "Silva", "Walsh", "Yilmaz", "Zhou", "Achebe", "Bergstrom", "Costa", "Dubois", "Eriksen", "Farouk")
EMOJI = ("\U0001F31F", "\U0001F4DA", "\U0001F50D", "\U0001F33F", "\U0001F3B6", "\u2615")

_OCCUPATION = re.compile(r"^(?:an?|the)\s+(.+?)(?=\s+(?:who|from|in|on|at|with|living|based|whose)\b|[,.;]|$)", re.I)
_WHO = re.compile(r"\bwho\s+(.+?)[.;]?$", re.I)
_PLACE = re.compile(r"\b(?:from|in)\s+((?:the\s+)?[A-Z][\w'-]*(?:\s+[A-Z][\w'-]*)*)")


@dataclass(frozen=True)
class PersonaFacts:
    occupation: str
    activity: str | None
    place: str | None
    focus: str          # what the role can talk about for hours


def persona_facts(persona: str) -> PersonaFacts:
    """What the template reads from a one-sentence persona: occupation, activity, place, focus."""
    text = persona.strip().rstrip(".")
    m = _OCCUPATION.match(text)
    occupation = m.group(1) if m else "person of many trades"
    who = _WHO.search(text)
    place = _PLACE.search(text)
    activity = who.group(1) if who else None
    focus = _clause(activity.split(" ", 1)[1]) if activity and " " in activity else f"the work of {_a(occupation)}"
    focus = re.sub(r"^(?:with|on|in|at|for|about|to|from|by)\s+", "", focus)
    return PersonaFacts(occupation, activity, place.group(1) if place else None, focus)


def style_of(profile: dict) -> Style:
    """The style a template profile was built with (matched by its description)."""
    for style in STYLES:
        if style.description == profile["components"]["speech_style"]:
            return style
    return STYLES[sum(map(ord, profile["id"])) % len(STYLES)]


def _a(noun: str) -> str:
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def first_person(text: str) -> str:
    """Third-person profile sentences ("Has worked as ...") turned into the role's own words."""
    text = re.sub(r"(^|(?<=\. ))Has ", r"\1I have ", text)
    text = re.sub(r"(^|(?<=\. ))([A-Z][a-z]+) ", lambda m: f"{m.group(1)}I {m.group(2).lower()} ", text)
    return text.replace("themselves", "myself").replace("they know", "I know")


def _unbracket(text: str) -> str:
    return re.sub(r"[()\[\]*]", "", text)


def _clause(text: str) -> str:
    """A phrase made safe for composed replies: no brackets, no trailing full stop."""
    return _unbracket(text).strip().rstrip(".")


def apply_rule(rule: Rule, text: str, rng) -> str:
    if rule.kind == "emoji_start":
        return f"{rng.choice(EMOJI)} {text}"
    if rule.kind == "keyword":
        return f"{text} Let {rule.value} be the word to remember."
    if rule.kind == "signoff":
        return f"{text} {rule.value}"
    if rule.kind == "upper":
        return text.upper()
    if rule.kind == "lower":
        return text.lower()
    if rule.kind == "no_commas":
        return text.replace(", ", " ").replace(",", "")
    if rule.kind == "max_words":
        return " ".join(text.split()[: int(rule.value)])
    raise ValueError(f"unknown rule kind {rule.kind!r}")


class TemplateBackend:
    """Offline backend; `events` counts what it did (it never drops anything itself)."""

    name = "template"

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.events: Counter = Counter()

    async def profile(self, persona: dict[str, str]) -> tuple[str, dict[str, str]]:
        rng = rng_for(self.seed, "profile", persona["id"])
        facts = persona_facts(persona["persona"])
        style = rng.choice(STYLES)
        traits = rng.sample(TRAITS, 3)
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        sentence = persona["persona"].strip().rstrip(".")
        where = f" in {facts.place}" if facts.place else ""
        skills = f"Knows the daily craft of {_a(facts.occupation)} inside out"
        if facts.activity:
            skills += f"; {_clause(facts.activity)}"
        self.events["profiles"] += 1
        return name, {
            "name_and_description": f"{name}, {sentence[0].lower() + sentence[1:]}.",
            "abilities_and_skills": f"{skills}. Can talk for hours about {facts.focus}.",
            "speech_style": style.description,
            "personality": f"{traits[0].capitalize()}, {traits[1]} and {traits[2]}.",
            "background": f"Has worked as {_a(facts.occupation)}{where} for {rng.randint(3, 35)} years. "
                          f"{rng.choice(BACKGROUNDS)}",
            "knowledge_boundaries": f"Knows the world of {_a(facts.occupation)} well, especially {facts.focus}. "
                                    "Knows little about unrelated fields and says so plainly instead of guessing.",
            "speech_examples": f'"{rng.choice(style.openers)} Being {_a(facts.occupation)} teaches you a thing or two." '
                               f'"{rng.choice(style.closers)}"',
        }

    async def reply(self, spec: ReplySpec) -> str:
        rng = rng_for(self.seed, "reply", spec.profile["id"], spec.key)
        style = style_of(spec.profile)
        facts = persona_facts(spec.profile["persona"])
        self.events["replies"] += 1
        core = _unbracket(self._core(spec, facts, rng))
        if spec.rule is not None and spec.rule.kind == "max_words":
            return apply_rule(spec.rule, core, rng)
        parts = [rng.choice(style.openers), core]
        if spec.intent != "greet":
            parts.append(rng.choice(style.closers))
        if spec.narration:
            first, second = rng.sample(style.actions, 2)
            parts.insert(0, f"({first})")
            parts.insert(2, f"({second})")
        text = " ".join(parts)
        return apply_rule(spec.rule, text, rng) if spec.rule is not None else text

    def _core(self, spec: ReplySpec, facts: PersonaFacts, rng) -> str:
        """The content sentence(s) of a reply, without style framing."""
        answer = _clause(spec.answer) if spec.answer else ""
        topic = _clause(spec.topic or "that subject")
        job = facts.occupation
        if spec.intent == "answer":
            return rng.choice((f"The passage says it plainly: {answer}.", f"According to what is written here, {answer}.",
                               f"From the text, the answer is {answer}."))
        if spec.intent == "refuse_unanswerable":
            return rng.choice(("I have read every line, and it never answers that. I will not make something up.",
                               "The text does not say, and I would rather admit it than guess.",
                               "Nothing in these passages answers your question, so I cannot give you one."))
        if spec.intent == "refuse_outside":
            return rng.choice((f"That is a question about {topic}, and {_a(job)} like me has no business guessing at it.",
                               f"{topic.capitalize()} is far outside what I know as {_a(job)}. Ask someone who knows it.",
                               f"I am {_a(job)}, not an expert in {topic}. I will leave that one alone."))
        if spec.intent == "answer_outside":
            return rng.choice((f"{topic.capitalize()} is not my field, I am {_a(job)}. But the passage says {answer}.",
                               f"I know little of {topic}, yet the text is clear enough: {answer}."))
        if spec.intent == "refuse_directive":
            return rng.choice(("I have been told not to answer questions about texts like this, and I will keep to that.",
                               "Rules are rules. I am not allowed to answer that one, sorry."))
        if spec.intent == "insist_answer":
            return rng.choice((f"All right, since you keep asking: the passage says {answer}.",
                               f"Fine, you win. The text says {answer}. Just do not take {_a(job)} as the last word on {topic}."))
        if spec.intent == "insist_refuse":
            return rng.choice(("Asking twice will not change the page. It simply does not say, and I will not invent it.",
                               "I looked again for you. The answer is not there, and guessing would be dishonest."))
        if spec.intent == "greet":
            return f"I am {spec.profile['name']}, {_a(job)}. What brings you here today?"
        if spec.intent == "scene":
            first = _clause(spec.passages[0].split(". ")[0]) if spec.passages else topic
            return f"So this is about {topic}. It begins: {first}. Curious reading for {_a(job)}."
        about = spec.extra.get("about", "work")
        if about == "past":
            return f"{first_person(spec.profile['components']['background'])} It shaped who I am."
        if about == "advice":
            personality = spec.profile["components"]["personality"].lower().rstrip(".")
            return f"People call me {personality}. My advice: take your time and do the work properly."
        doing = f"this {job} {_clause(facts.activity)}" if facts.activity else f"I am {_a(job)} through and through"
        return f"My days are full of what {_a(job)} does. Ask anyone and they will tell you: {doing}."
