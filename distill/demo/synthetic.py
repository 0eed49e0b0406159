"""A seeded corpus of short support messages whose answers the generator knows: the demo's data.

Messages are composed from parts, and each knows its latent answers to three questions (urgent,
department, severity). The labels it hands out as a stand-in teacher are soft, sometimes split or
uncertain, and flipped for a share of items (``LABEL_NOISE``), as a real teacher's would be. Item
``i`` of a seed is the same whatever ``n`` is. See docs/getting-started.md.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cascade.checks import is_int
from cascade.errors import CascadeError
from cascade.questions import Question, parse_request

GENERATOR_VERSION = "support-v1"
"""Changes whenever a given (seed, index) would give another text or label."""
LABEL_NOISE = 0.01
"""Share of (item, question) labels the stand-in teacher gets confidently wrong."""
MIXED_SHARE = 0.12
"""Share of messages that add a minor second issue for another department."""
AMBIGUOUS_SHARE = 0.08
"""Share of messages whose one problem plausibly belongs to either of two departments."""

DEPARTMENTS: dict[str, str] = {
    "billing": "Charges, invoices, refunds, payments",
    "technical": "Bugs, errors, slowness, outages",
    "account": "Login, passwords, access, profile, security",
    "shipping": "Deliveries, tracking, damaged or wrong goods",
    "sales": "Prices, plans, quotes, buying more",
}
SEVERITY_LEVELS = [
    "Minor: a question or cosmetic issue",
    "Moderate: works, but badly or only partly",
    "Major: the customer cannot do their work",
    "Critical: money, data or security at risk for many",
]
QUESTIONS_JSON: dict[str, Any] = {
    "urgent": {"type": "noul", "instructions": "Does the sender need action within hours?"},
    "department": {"type": "choice", "instructions": "Which team should handle this message?",
                   "criteria": DEPARTMENTS},
    "severity": {"type": "score", "instructions": "How severe is the problem?",
                 "criteria": SEVERITY_LEVELS},
}
URGENT_GIVEN_SEVERITY = (0.08, 0.25, 0.6, 0.9)
"""P(urgent | severity level): urgency follows severity, but not always."""

_FILL = {
    "product": ["the dashboard", "the mobile app", "the Android app", "the iOS app", "the web app",
                "the reporting module", "the API", "the desktop client", "the calendar view",
                "the inbox", "the analytics page", "the browser extension"],
    "item": ["standing desk", "office chair", "monitor arm", "laptop stand", "headset", "router",
             "printer", "coffee machine", "webcam", "docking station", "keyboard", "label printer"],
    "city": ["Leeds", "Lyon", "Porto", "Gdansk", "Tampere", "Bilbao", "Cork", "Graz", "Malmo"],
    "country": ["Norway", "Iceland", "Canada", "Switzerland", "Japan", "Chile", "Ireland"],
    "deadline": ["5pm today", "end of day", "tomorrow's board meeting", "Monday's launch",
                 "the audit tomorrow", "tonight's release", "the client demo at noon"],
    "plan": ["Pro", "Team", "Business", "Starter", "Enterprise"],
}
_PROBLEMS: dict[str, list[list[str]]] = {
    "billing": [
        ["Could you send me a copy of last month's invoice?",
         "The billing address on our invoices still shows our old office.",
         "Can we switch from monthly to annual billing at renewal?",
         "What does the line 'service fee' on invoice {invoice} mean?",
         "Which card do you have on file for us? I'd like to check before the renewal."],
        ["I was charged {amount} twice for the same month.",
         "My refund of {amount} for order {order} still hasn't arrived after {days} days.",
         "The invoice total doesn't match the price we agreed.",
         "A discount we were promised was not applied, so we paid {amount} too much."],
        ["Our payment keeps getting declined and the account is now suspended.",
         "We can't download any invoices, so our finance team can't close the month.",
         "Your system cancelled our subscription after a failed charge and the team lost access."],
        ["We were charged {amount} {times} times this morning and our bank account is overdrawn.",
         "Payouts to all {users} of our sellers have failed for {days} days.",
         "Every one of our customers was billed twice yesterday and chargebacks are coming in."],
    ],
    "technical": [
        ["The colours in dark mode on {product} look a bit off.",
         "Is there a keyboard shortcut to archive messages in {product}?",
         "There's a typo in a tooltip in {product}.",
         "How do I change the date format in the report export?"],
        ["{Product} has been slow since the last update; pages take {secs} seconds to load.",
         "The CSV export sometimes drops the last column.",
         "Notifications from {product} arrive hours late.",
         "Search in {product} misses results now and then."],
        ["{Product} crashes every time I open a project, so I can't work.",
         "All our API calls have returned error 500 since this morning.",
         "Sync has stopped completely and nobody can save changes.",
         "I get a blank screen after logging in to {product}."],
        ["Your outage has taken our checkout down; {users} customers cannot pay.",
         "Records in {product} are disappearing after the update; we've lost {days} days of data.",
         "Production is down: every request to the API times out."],
    ],
    "account": [
        ["How do I change the email address on my profile?",
         "Can I rename our workspace?",
         "I'd like to add a second admin to our team.",
         "Where can I turn off the weekly summary emails?"],
        ["The password reset email takes ages to arrive.",
         "Two-factor codes are rejected every other try.",
         "A colleague I invited can't see our shared folders."],
        ["I'm locked out of my account and the reset link doesn't work.",
         "My account was deactivated by mistake and I can't log in.",
         "None of our new hires can accept their invitations, so they can't log in."],
        ["Someone logged into our admin account from abroad and changed the password.",
         "I think our account was hacked: {users} users got emails we never sent.",
         "Our whole company is locked out after an SSO change; {users} people cannot log in."],
    ],
    "shipping": [
        ["Which carrier do you use for deliveries to {city}?",
         "Can I change the delivery address for a future order?",
         "Do you ship to {country}?",
         "Could the {item} be delivered without the extra packaging?"],
        ["Order {order} is {days} days late and tracking hasn't updated.",
         "The box was damaged in transit, though the {item} inside seems fine.",
         "I received the {item} in the wrong colour."],
        ["Order {order} says delivered but never arrived, and I need the {item} to work.",
         "The {item} arrived broken and can't be used at all.",
         "We got someone else's parcel instead of our {item}."],
        ["None of the {users} units for our store opening arrived; the shipment is lost.",
         "The {item} you shipped overheated and started to smoke.",
         "A pallet of {users} orders went to the wrong warehouse and our customers are furious."],
    ],
    "sales": [
        ["Do you offer discounts for non-profits?",
         "Could you send me a price list for the {plan} plan?",
         "What's the difference between the {plan} and Business plans?",
         "Do you have a trial for the {plan} plan?"],
        ["We were quoted {amount} but the website now shows more; will you honour the quote?",
         "I'd like to upgrade to {seats} seats but the upgrade page gives me a different price.",
         "We want to add {seats} seats; who can give us a volume price?"],
        ["We need a signed quote before procurement closes the budget at {deadline}.",
         "We want to buy {seats} licences but nobody has answered our purchase order.",
         "Our {plan} trial ends today and we need a quote to keep working."],
        ["Our renewal of {seats} seats lapses tonight and everyone loses access without a contract.",
         "We're ready to sign a {amount} contract, but sales hasn't replied in {days} days.",
         "A competitor's offer expires today; we need your final price for {seats} seats now."],
    ],
}
_AMBIGUOUS: list[tuple[str, str, int, str]] = [
    # (department, other plausible department, severity, text)
    ("billing", "technical", 1, "The payment page throws an error when I enter my card."),
    ("technical", "billing", 2, "The invoice page crashes whenever I open it."),
    ("technical", "account", 2, "The login page shows error 502 for everyone on our team."),
    ("account", "technical", 1, "I keep getting logged out of {product} every few minutes."),
    ("shipping", "billing", 1, "I returned the {item} {days} days ago and still have no refund."),
    ("billing", "shipping", 1, "I was charged for express delivery but the {item} came by post."),
    ("sales", "billing", 1, "Why is my renewal invoice higher than the quote we signed?"),
    ("billing", "sales", 0, "Is the {plan} plan price per month or per year?"),
    ("account", "billing", 1, "I can't update the card on my profile."),
    ("sales", "account", 0, "How many users can we add on the {plan} plan?"),
    ("technical", "shipping", 1, "The tracking link in your email gives a 404."),
    ("account", "sales", 2, "Our plan was downgraded and half the team lost access."),
]
_SUBJECTS = {
    "billing": ["Invoice question", "Double charge", "Refund", "Payment issue", "Billing"],
    "technical": ["Bug report", "App problem", "Error", "Something's broken", "Performance"],
    "account": ["Login problem", "Account access", "Profile", "Password", "Security"],
    "shipping": ["Where is my order?", "Delivery", "Damaged item", "Order {order}", "Shipping"],
    "sales": ["Quote request", "Pricing", "Upgrade", "Licences", "Plans"],
}
_GENERIC_SUBJECTS = ["Help", "Question", "Support request", "Problem", "Hi", "Issue"]
_GREETINGS = ["Hi,", "Hello,", "Hello team,", "Dear support,", "Hey,", "Hi there,", "Good morning,",
              "To whom it may concern,", ""]
_OPENINGS = ["", "", "", "I hope you can help.", "Writing from {company}.", "Quick one:",
             "I'm the office manager at {company}.", "First time contacting you.",
             "Following up on my earlier message.", "I've been a customer for years."]
_URGENT_CUES = ["Please treat this as urgent.", "We need this fixed today.", "ASAP please!",
                "I need an answer before {deadline}.", "Please call me back right away.",
                "This can't wait.", "Urgent: please escalate.", "Every hour counts here."]
_CALM_CUES = ["No rush on this.", "Whenever you have time.", "Not urgent at all.",
              "Happy to wait for a reply next week.", "Take your time.", "It can wait."]
_IMPLIED_URGENT = ["We need it for {deadline}.", "Our customers are waiting.",
                   "The whole team is watching this thread."]
_IMPACT = [
    ["It's only a small thing.", "Just curious.", "Nothing is broken.", "Only cosmetic."],
    ["We can work around it for now.", "It's annoying but not blocking.", "It slows us down a bit."],
    ["I can't do my job until this is fixed.", "This is blocking our team.", "We're stuck."],
    ["This is costing us money every hour.", "All of our customers are affected.",
     "This is a serious risk for our business."],
]
_CLOSINGS = ["Thanks,", "Thanks!", "Best regards,", "Cheers,", "Kind regards,", "Regards,", "Best,",
             "Thank you,", ""]
_FIRST = ["Anna", "Ben", "Chloe", "David", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kaito",
          "Lena", "Marco", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Sven", "Tariq", "Uma",
          "Viktor", "Wen", "Yara", "Zoe"]
_LAST = ["Novak", "Smith", "Garcia", "Okafor", "Lindqvist", "Rossi", "Kowalski", "Tanaka", "Dubois",
         "Silva", "Murphy", "Haddad", "Jensen", "Moreau", "Costa", "Fischer"]
_COMPANIES = ["Northwind", "Bluebird Studio", "Acme Foods", "Greenleaf", "Harbor Dental",
              "Pixel & Co", "Orbit Labs", "Sunny Bakery", "Falcon Freight", "Maple Clinic"]
_SLOT = re.compile(r"\{(\w+)\}")


class SyntheticError(CascadeError, ValueError):
    """The generator was asked for something it cannot make (a bad count or seed)."""


@dataclass(frozen=True)
class SyntheticItem:
    """One message, its latent answers, and the stand-in teacher's (soft, noisy) labels.

    ``labels`` maps question id -> option key -> probability, in the questions' option order.
    """

    id: str
    text: str
    urgent: bool
    department: str
    severity: int
    labels: dict[str, dict[str, float]]

    def teacher_answers(self) -> dict[str, str]:
        """The teacher's argmax option key per question."""
        return {qid: max(probs, key=probs.__getitem__) for qid, probs in self.labels.items()}


def demo_questions() -> dict[str, Question]:
    """The three questions, validated as a System One request's."""
    request = parse_request({"state": "placeholder", "questions": QUESTIONS_JSON})
    return dict(request.questions)


def generate(n: int, seed: int = 0) -> list[SyntheticItem]:
    """``n`` messages for ``seed``; item ``i`` depends on (seed, i) only, never on ``n``."""
    if not is_int(n) or n < 1:
        raise SyntheticError(f"n (the number of items) must be a whole number >= 1; got {n!r}")
    if not is_int(seed):
        raise SyntheticError(f"seed must be a whole number; got {seed!r}")
    return [_item(seed, index) for index in range(n)]


def item_id(seed: int, index: int) -> str:
    """Ids carry the seed, so that corpora of different seeds never share an id."""
    return f"{GENERATOR_VERSION}-s{seed}-{index:05d}"


def write_corpus(items: Iterable[SyntheticItem], path: Path) -> Path:
    """The corpus as JSONL ``{"id", "text"}`` lines: what ``cascade.corpus.read_corpus`` reads."""
    return _write_lines(path, ({"id": item.id, "text": item.text} for item in items))


def write_labels(items: Iterable[SyntheticItem], path: Path) -> Path:
    """The teacher labels as ``distill.labelling.transfer.import_labels`` rows ``{"id", "question",
    "probabilities"}``."""
    rows = ({"id": item.id, "question": qid, "probabilities": probs}
            for item in items for qid, probs in item.labels.items())
    return _write_lines(path, rows)


def write_questions(path: Path) -> Path:
    """The questions file (``{"questions": ...}``) that ``cascade.corpus.load_questions`` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"questions": QUESTIONS_JSON}, indent=2) + "\n", encoding="utf-8")
    return path


def _write_lines(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


@dataclass
class _Draft:
    """The latent answers of a message being composed, and how sure a reader could be of them."""

    department: str
    severity: int
    urgent: bool
    other_department: str | None = None
    department_sure: float = 0.95
    urgency_sure: float = 0.95


def _item(seed: int, index: int) -> SyntheticItem:
    rng = random.Random(f"cascade-demo:{GENERATOR_VERSION}:{seed}:{index}")
    draft, problem = _problem(rng)
    text = _compose(rng, draft, problem)
    labels = _teacher_labels(rng, draft)
    return SyntheticItem(item_id(seed, index), text, draft.urgent, draft.department, draft.severity,
                         labels)


def _problem(rng: random.Random) -> tuple[_Draft, str]:
    """The message's main problem and the latent answers it implies."""
    if rng.random() < AMBIGUOUS_SHARE:
        first, second, severity, text = rng.choice(_AMBIGUOUS)
        department, other = (first, second) if rng.random() < 0.6 else (second, first)
        urgent = rng.random() < URGENT_GIVEN_SEVERITY[severity]
        draft = _Draft(department, severity, urgent, other, department_sure=rng.uniform(0.5, 0.65))
        return draft, text
    department = rng.choice(list(DEPARTMENTS))
    severity = rng.choices(range(len(SEVERITY_LEVELS)), weights=(0.3, 0.3, 0.25, 0.15))[0]
    urgent = rng.random() < URGENT_GIVEN_SEVERITY[severity]
    draft = _Draft(department, severity, urgent, department_sure=rng.uniform(0.82, 0.98))
    return draft, rng.choice(_PROBLEMS[department][severity])


def _compose(rng: random.Random, draft: _Draft, problem: str) -> str:
    """Subject, greeting, body and signature around the problem, with cues and typos."""
    body = [rng.choice(_OPENINGS), problem]
    if rng.random() < 0.6:
        body.append(rng.choice(_IMPACT[draft.severity]))
    cue = _urgency_cue(rng, draft)
    body.insert(1 if rng.random() < 0.4 else len(body), cue)
    if draft.other_department is None and rng.random() < MIXED_SHARE:
        draft.other_department = rng.choice([d for d in DEPARTMENTS if d != draft.department])
        draft.department_sure = rng.uniform(0.65, 0.85)
        aside = rng.choice(_PROBLEMS[draft.other_department][0])
        body.append(f"{rng.choice(['Also,', 'P.S.', 'One more thing:', 'Unrelated, but'])} "
                    f"{aside[0].lower()}{aside[1:]}")
    text = _typos(rng, _fill(rng, " ".join(part for part in body if part)))
    lines = [_fill(rng, _subject(rng, draft)), rng.choice(_GREETINGS), text,
             f"{rng.choice(_CLOSINGS)}\n{_signature(rng)}".strip()]
    return "\n\n".join(line for line in lines if line)


def _subject(rng: random.Random, draft: _Draft) -> str:
    if rng.random() < 0.4:
        return ""
    subject = rng.choice(_SUBJECTS[draft.department] if rng.random() < 0.7 else _GENERIC_SUBJECTS)
    if draft.urgent and rng.random() < 0.4:
        subject = f"URGENT: {subject}"
    return f"Subject: {subject}"


def _urgency_cue(rng: random.Random, draft: _Draft) -> str:
    """An explicit cue most of the time; an implied or missing one makes the label less sure."""
    roll = rng.random()
    if draft.urgent:
        if roll < 0.75:
            cue = rng.choice(_URGENT_CUES)
            return cue.upper() if rng.random() < 0.1 else cue
        draft.urgency_sure = rng.uniform(0.55, 0.8)
        return rng.choice(_IMPLIED_URGENT) if roll < 0.9 else ""
    if roll < 0.45:
        return rng.choice(_CALM_CUES)
    draft.urgency_sure = rng.uniform(0.7, 0.95)
    return ""


def _signature(rng: random.Random) -> str:
    name = rng.choice(_FIRST)
    if rng.random() < 0.5:
        name = f"{name} {rng.choice(_LAST)}"
    if rng.random() < 0.3:
        name = f"{name}\n{rng.choice(_COMPANIES)}"
    return name


def _fill(rng: random.Random, text: str) -> str:
    """Replace each {slot} with a value drawn for it (a capitalised slot gives a capitalised value)."""
    def value(match: re.Match[str]) -> str:
        slot = match.group(1)
        filled = _slot_value(rng, slot.lower())
        return filled[0].upper() + filled[1:] if slot[0].isupper() else filled
    return _SLOT.sub(value, text)


def _slot_value(rng: random.Random, slot: str) -> str:
    numbers = {
        "amount": lambda: f"${rng.choice([19, 49, 99, 120, 249, 480, 1200, 5400, 18000]):,}",
        "order": lambda: f"#{rng.randint(10000, 99999)}",
        "invoice": lambda: f"INV-{rng.randint(1000, 9999)}",
        "days": lambda: str(rng.randint(2, 14)),
        "secs": lambda: str(rng.randint(5, 40)),
        "times": lambda: rng.choice(["three", "four", "five"]),
        "users": lambda: str(rng.choice([40, 120, 300, 850, 2000])),
        "seats": lambda: str(rng.choice([5, 10, 25, 60, 200])),
    }
    if slot in numbers:
        return numbers[slot]()
    if slot == "company":
        return rng.choice(_COMPANIES)
    return rng.choice(_FILL[slot])


def _typos(rng: random.Random, text: str) -> str:
    """Hasty writing: swapped letters, no capitals, no final full stops."""
    if rng.random() < 0.15:
        for _ in range(rng.randint(1, 3)):
            text = _swap_letters(rng, text)
    if rng.random() < 0.06:
        text = text.lower()
    if rng.random() < 0.06:
        text = text.replace(". ", " ").rstrip(".")
    return text


def _swap_letters(rng: random.Random, text: str) -> str:
    words = [m for m in re.finditer(r"[a-z]{4,}", text)]
    if not words:
        return text
    word = rng.choice(words)
    at = rng.randrange(word.start(), word.end() - 1)
    return text[:at] + text[at + 1] + text[at] + text[at + 2 :]


def _teacher_labels(rng: random.Random, draft: _Draft) -> dict[str, dict[str, float]]:
    """Soft labels around the latent answers; each question flipped with prob LABEL_NOISE."""
    urgent = _flip(rng, int(draft.urgent), 2, ordinal=False)
    department = list(DEPARTMENTS).index(draft.department)
    other = list(DEPARTMENTS).index(draft.other_department) if draft.other_department else None
    if other is not None and draft.department_sure < 0.65 and rng.random() < 0.3:
        department, other = other, department
    flipped = _flip(rng, department, len(DEPARTMENTS), ordinal=False)
    department, other = (flipped, department) if flipped != department else (department, other)
    severity = _flip(rng, draft.severity, len(SEVERITY_LEVELS), ordinal=True)
    severity_sure = rng.uniform(0.6, 0.9)
    return {
        "urgent": _spread(["true", "false"], 1 - urgent, round(draft.urgency_sure, 6), None),
        "department": _spread(list(DEPARTMENTS), department, draft.department_sure, other),
        "severity": _spread([str(i) for i in range(len(SEVERITY_LEVELS))], severity, severity_sure,
                            None, ordinal=True),
    }


def _flip(rng: random.Random, answer: int, options: int, ordinal: bool) -> int:
    """The answer, or with probability LABEL_NOISE another one (a neighbouring level if ordinal)."""
    if rng.random() >= LABEL_NOISE:
        return answer
    if ordinal:
        return answer + 1 if answer == 0 or (answer < options - 1 and rng.random() < 0.5) else answer - 1
    return rng.choice([o for o in range(options) if o != answer])


def _spread(
    keys: Sequence[str], top: int, sure: float, second: int | None, ordinal: bool = False
) -> dict[str, float]:
    """``sure`` on ``top``; the rest mostly on ``second`` (or the neighbours if ordinal), a little
    on every other option, so that no probability is exactly zero."""
    weights = [0.05] * len(keys)
    near = [second] if second is not None else []
    if ordinal:
        near = [i for i in (top - 1, top + 1) if 0 <= i < len(keys)]
    for i in near:
        weights[i] = 1.0
    weights[top] = 0.0
    rest = (1 - sure) / sum(weights)
    probs = [round(w * rest, 6) for w in weights]
    probs[top] = 1 - sum(probs)
    return dict(zip(keys, probs, strict=True))
