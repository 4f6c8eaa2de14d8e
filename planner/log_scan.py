"""The compiled fast path of the JSON-lines log reader: whole lines of a chunk of bytes to (model id, time,
prompt tokens, completion tokens), at several million lines a second on one core.

It reads the common shape of a request record and nothing else: a JSON object whose strings hold no escape
and no control character, whose numbers are plain (at most 2^53 in their digits, a decimal exponent within
±22: exactly what ``float`` gives, by Clinger's fast path), whose times are epoch numbers or ISO 8601 as
``YYYY-MM-DD[(T| )HH:MM[:SS[.ffffff]]][Z|±HH:MM]``, and whose values of the keys read are well-formed and
in bounds. Any other line, including every line that is an error, goes to the exact path
(``planner.traffic``, the ``json`` module) unread here: results are identical by construction, and
``tests/test_log_streaming.py`` checks it on random lines.

Model names map to dense ids through an open-addressing table of FNV-1a hashes, keyed by the name's bytes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

TIME_KEYS = ("timestamp", "time", "created", "start_time", "startTime")  # by priority: the first present is read
MODEL_KEYS = ("model", "model_group")  # LiteLLM: model_group (the name asked for), else model
TOKEN_KEYS = ("prompt_tokens", "completion_tokens")  # at top level, else in "usage"

# -- key codes: the keys a record is read by ------------------------------------------------------------------
_KEYS = [*TIME_KEYS, *MODEL_KEYS, *TOKEN_KEYS, "usage"]
K_MODEL, K_GROUP = len(TIME_KEYS), len(TIME_KEYS) + 1
K_PROMPT, K_COMPLETION = K_GROUP + 1, K_GROUP + 2
K_USAGE = K_GROUP + 3
_KEY_BYTES = np.frombuffer("".join(_KEYS).encode("ascii"), np.uint8).copy()
_KEY_END = np.cumsum([len(k) for k in _KEYS]).astype(np.int64)
START_TIME = TIME_KEYS.index("startTime")

# -- scan outcomes --------------------------------------------------------------------------------------------
DONE, FULL, GROW = 0, 1, 2  # the chunk is read; the output arrays are full; the name table must grow
_FALLBACK = -1

MAX_DEPTH = 64  # nesting the fast path follows; deeper lines go to the exact path
_TWO53 = 9007199254740992
_POW10 = np.array([10.0 ** k for k in range(23)])
_WS = np.zeros(256, np.bool_)
_WS[[0x20, 0x09, 0x0D]] = True  # JSON's whitespace but the newline, which ends a line: nothing read crosses it
_BLANK = np.zeros(256, np.bool_)
_BLANK[[0x20, 0x09, 0x0D, 0x0B, 0x0C]] = True


class Names:
    """Model names seen so far, as dense ids: a hash table the scanner reads and extends."""

    def __init__(self, slots: int = 1 << 12, store: int = 1 << 16) -> None:
        self.slots = np.full(slots, -1, np.int64)  # id at each slot, -1 empty
        self.hashes = np.zeros(slots // 2, np.uint64)  # per id
        self.start = np.zeros(slots // 2, np.int64)  # per id: its bytes in store
        self.length = np.zeros(slots // 2, np.int64)
        self.store = np.zeros(store, np.uint8)
        self.state = np.zeros(2, np.int64)  # ids, store bytes used
        self.text: list[str] = []

    def __len__(self) -> int:
        return int(self.state[0])

    def grow(self, need_bytes: int = 0) -> None:
        """Double the table (and the store, if ``need_bytes`` more would not fit)."""
        n = len(self)
        if 2 * (n + 1) > self.slots.size // 2 or n + 1 >= self.hashes.size:
            self.slots = np.full(self.slots.size * 2, -1, np.int64)
            _rehash(self.slots, self.hashes, n)
            for name in ("hashes", "start", "length"):
                old = getattr(self, name)
                grown = np.zeros(self.slots.size // 2, old.dtype)
                grown[:n] = old[:n]
                setattr(self, name, grown)
        used = int(self.state[1])
        if used + need_bytes > self.store.size:
            grown = np.zeros(max(2 * self.store.size, used + need_bytes), np.uint8)
            grown[:used] = self.store[:used]
            self.store = grown

    def id_of(self, name: str) -> int:
        """The id of ``name`` (a new one if unseen); the exact path's names go through here too."""
        raw = np.frombuffer(name.encode("utf-8", "surrogatepass"), np.uint8)
        while True:
            found = _lookup(raw, 0, raw.size, self.slots, self.hashes, self.start, self.length, self.store,
                            self.state)
            if found >= 0:
                self.sync()
                return found
            self.grow(raw.size)

    def sync(self) -> None:
        """Decode the names the scanner added since the last call."""
        for k in range(len(self.text), len(self)):
            s = int(self.start[k])
            self.text.append(bytes(self.store[s:s + self.length[k]]).decode("utf-8", "surrogatepass"))


@njit(cache=True, nogil=True)
def _fnv(b, s, e):
    h = np.uint64(0xCBF29CE484222325)
    for i in range(s, e):
        h = (h ^ np.uint64(b[i])) * np.uint64(0x100000001B3)
    return h


@njit(cache=True, nogil=True)
def _rehash(slots, hashes, n):
    mask = slots.size - 1
    for k in range(n):
        j = np.int64(hashes[k] & np.uint64(mask))
        while slots[j] >= 0:
            j = (j + 1) & mask
        slots[j] = k


@njit(cache=True, nogil=True)
def _lookup(b, s, e, slots, hashes, start, length, store, state):
    """The id of the name b[s:e], added if new; -1 when the table or the store must grow first."""
    h = _fnv(b, s, e)
    mask = slots.size - 1
    j = np.int64(h & np.uint64(mask))
    n = e - s
    while slots[j] >= 0:
        k = slots[j]
        if hashes[k] == h and length[k] == n and _same_bytes(store, start[k], b, s, n):
            return k
        j = (j + 1) & mask
    k = state[0]
    if 2 * (k + 1) > slots.size // 2 or k + 1 >= hashes.size or state[1] + n > store.size:
        return -1
    slots[j] = k
    hashes[k] = h
    start[k] = state[1]
    length[k] = n
    store[state[1]:state[1] + n] = b[s:e]
    state[0] = k + 1
    state[1] += n
    return k


# -- JSON pieces: each returns the index after what it read, or _FALLBACK ------------------------------------

@njit(cache=True, nogil=True)
def _ws(b, i, e):
    while i < e and _WS[b[i]]:
        i += 1
    return i


@njit(cache=True, nogil=True)
def _string(b, i, e):
    """b[i] is '"': the index after the closing quote. Escapes and control characters are the exact path's;
    other bytes must be UTF-8 (no overlong form, no surrogate, at most U+10FFFF)."""
    i += 1
    while i < e:
        c = b[i]
        if c == 0x22:
            return i + 1
        if c == 0x5C or c < 0x20:
            return _FALLBACK
        if c < 0x80:
            i += 1
            continue
        if 0xC2 <= c <= 0xDF:
            n, lo, hi = 1, 0x80, 0xBF
        elif 0xE0 <= c <= 0xEF:
            n = 2
            lo = 0xA0 if c == 0xE0 else 0x80
            hi = 0x9F if c == 0xED else 0xBF
        elif 0xF0 <= c <= 0xF4:
            n = 3
            lo = 0x90 if c == 0xF0 else 0x80
            hi = 0x8F if c == 0xF4 else 0xBF
        else:
            return _FALLBACK
        if i + n >= e or not (lo <= b[i + 1] <= hi):
            return _FALLBACK
        for k in range(2, n + 1):
            if not (0x80 <= b[i + k] <= 0xBF):
                return _FALLBACK
        i += n + 1
    return _FALLBACK


@njit(cache=True, nogil=True)
def _number(b, i, e, out):
    """A JSON number at b[i]: out[0] its value when exactly representable by the fast path, else NaN (valid
    JSON all the same). Returns the index after it."""
    neg = b[i] == 0x2D
    if neg:
        i += 1
    if i >= e or not (0x30 <= b[i] <= 0x39):
        return _FALLBACK
    m = np.int64(0)
    exact = True
    if b[i] == 0x30:
        i += 1
        if i < e and 0x30 <= b[i] <= 0x39:
            return _FALLBACK  # a leading zero
    else:
        while i < e and 0x30 <= b[i] <= 0x39:
            m = m * 10 + (b[i] - 0x30)
            if m > _TWO53:
                exact = False
                m = _TWO53
            i += 1
    e10 = 0
    if i < e and b[i] == 0x2E:
        i += 1
        if i >= e or not (0x30 <= b[i] <= 0x39):
            return _FALLBACK
        while i < e and 0x30 <= b[i] <= 0x39:
            m = m * 10 + (b[i] - 0x30)
            e10 -= 1
            if m > _TWO53:
                exact = False
                m = _TWO53
            i += 1
    if i < e and (b[i] == 0x65 or b[i] == 0x45):
        i += 1
        sign = 1
        if i < e and (b[i] == 0x2B or b[i] == 0x2D):
            sign = -1 if b[i] == 0x2D else 1
            i += 1
        if i >= e or not (0x30 <= b[i] <= 0x39):
            return _FALLBACK
        x = 0
        while i < e and 0x30 <= b[i] <= 0x39:
            if x < 100000:
                x = x * 10 + (b[i] - 0x30)
            i += 1
        e10 += sign * x
    if not exact or e10 > 22 or e10 < -22:
        out[0] = np.nan
    elif e10 >= 0:
        out[0] = float(m) * _POW10[e10]
    else:
        out[0] = float(m) / _POW10[-e10]
    if neg:
        out[0] = -out[0]
    return i


@njit(cache=True, nogil=True)
def _literal(b, i, e):
    """true, false or null at b[i]: the index after it."""
    if b[i] == 0x74 and i + 4 <= e and b[i + 1] == 0x72 and b[i + 2] == 0x75 and b[i + 3] == 0x65:
        return i + 4
    if b[i] == 0x66 and i + 5 <= e and b[i + 1] == 0x61 and b[i + 2] == 0x6C and b[i + 3] == 0x73 \
            and b[i + 4] == 0x65:
        return i + 5
    if b[i] == 0x6E and i + 4 <= e and b[i + 1] == 0x75 and b[i + 2] == 0x6C and b[i + 3] == 0x6C:
        return i + 4
    return _FALLBACK


@njit(cache=True, nogil=True)
def _member_key(b, i, e):
    """After '{' or ',': a key string and its ':'. Returns the key's code (:func:`_key_code`) and the index of
    the value (or _FALLBACK)."""
    i = _ws(b, i, e)
    if i >= e or b[i] != 0x22:
        return -1, _FALLBACK
    j = _string(b, i, e)
    if j < 0:
        return -1, _FALLBACK
    key = _key_code(b, i + 1, j - 1)
    j = _ws(b, j, e)
    if j >= e or b[j] != 0x3A:
        return -1, _FALLBACK
    j = _ws(b, j + 1, e)
    return key, (j if j < e else _FALLBACK)


@njit(cache=True, nogil=True)
def _skip(b, i, e, stack, num):
    """Any JSON value at b[i] (nested up to MAX_DEPTH): the index after it."""
    depth = 0
    while True:
        i = _ws(b, i, e)
        if i >= e:
            return _FALLBACK
        c = b[i]
        opened = False
        if c == 0x7B or c == 0x5B:
            close = 0x7D if c == 0x7B else 0x5D
            j = _ws(b, i + 1, e)
            if j < e and b[j] == close:
                i = j + 1
            else:
                if depth == MAX_DEPTH:
                    return _FALLBACK
                stack[depth] = c
                depth += 1
                i = _member_key(b, i + 1, e)[1] if c == 0x7B else i + 1
                opened = True
        elif c == 0x22:
            i = _string(b, i, e)
        elif c == 0x2D or 0x30 <= c <= 0x39:
            i = _number(b, i, e, num)
        else:
            i = _literal(b, i, e)
        if i < 0:
            return _FALLBACK
        if opened:
            continue
        while True:  # a value is complete: close containers or move to the next member
            if depth == 0:
                return i
            i = _ws(b, i, e)
            if i >= e:
                return _FALLBACK
            c = b[i]
            top = stack[depth - 1]
            if c == 0x2C:
                i = _member_key(b, i + 1, e)[1] if top == 0x7B else i + 1
                if i < 0:
                    return _FALLBACK
                break
            if (c == 0x7D and top == 0x7B) or (c == 0x5D and top == 0x5B):
                i += 1
                depth -= 1
                continue
            return _FALLBACK


@njit(cache=True, nogil=True)
def _same_bytes(a, a_start, b, b_start, n):
    """Whether a[a_start:a_start + n] and b[b_start:b_start + n] hold the same bytes."""
    for i in range(n):
        if a[a_start + i] != b[b_start + i]:
            return False
    return True


@njit(cache=True, nogil=True)
def _key_code(b, s, e):
    """The index in _KEYS of the key b[s:e] (quotes excluded), or -1."""
    n = e - s
    lo = 0
    for k in range(_KEY_END.size):
        hi = _KEY_END[k]
        if hi - lo == n and _same_bytes(_KEY_BYTES, lo, b, s, n):
            return k
        lo = hi
    return -1


@njit(cache=True, nogil=True)
def _digits(b, i, n):
    v = 0
    for k in range(i, i + n):
        d = b[k] - 0x30
        if d < 0 or d > 9:
            return -1
        v = v * 10 + d
    return v


@njit(cache=True, nogil=True)
def _days_from_civil(y, m, d):
    if m <= 2:
        y -= 1
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


@njit(cache=True, nogil=True)
def _iso(b, s, e):
    """Epoch seconds of the ISO 8601 time b[s:e] in the form the module names (as ``datetime.fromisoformat``
    then ``timestamp()`` give it, naive times in UTC), or NaN."""
    if e - s < 10 or b[s + 4] != 0x2D or b[s + 7] != 0x2D:
        return np.nan
    y, mo, d = _digits(b, s, 4), _digits(b, s + 5, 2), _digits(b, s + 8, 2)
    if y < 1 or mo < 1 or mo > 12 or d < 1:
        return np.nan
    leap = (y % 4 == 0 and y % 100 != 0) or y % 400 == 0
    mdays = 29 if mo == 2 and leap else (28 if mo == 2 else (30 if mo in (4, 6, 9, 11) else 31))
    if d > mdays:
        return np.nan
    i = s + 10
    hh = mm = ss = us = off = 0
    if i < e:
        if (b[i] != 0x54 and b[i] != 0x20) or i + 6 > e or b[i + 3] != 0x3A:
            return np.nan
        hh, mm = _digits(b, i + 1, 2), _digits(b, i + 4, 2)
        if hh < 0 or hh > 23 or mm < 0 or mm > 59:
            return np.nan
        i += 6
        if i < e and b[i] == 0x3A:
            if i + 3 > e:
                return np.nan
            ss = _digits(b, i + 1, 2)
            if ss < 0 or ss > 59:
                return np.nan
            i += 3
            if i < e and b[i] == 0x2E:
                n = 0
                i += 1
                while i < e and 0x30 <= b[i] <= 0x39:
                    n += 1
                    i += 1
                if n < 1 or n > 6:
                    return np.nan
                us = _digits(b, i - n, n) * 10 ** (6 - n)
        if i < e:
            if b[i] == 0x5A and i + 1 == e:
                i += 1
            elif (b[i] == 0x2B or b[i] == 0x2D) and i + 6 == e and b[i + 3] == 0x3A:
                oh, om = _digits(b, i + 1, 2), _digits(b, i + 4, 2)
                if oh < 0 or oh > 23 or om < 0 or om > 59:
                    return np.nan
                off = (oh * 60 + om) * 60 * (1 if b[i] == 0x2B else -1)
                i = e
            else:
                return np.nan
    total = ((_days_from_civil(y, mo, d) * 86400 + hh * 3600 + mm * 60 + ss - off) * 1000000) + us
    if total < 0 or total >= _TWO53:
        return np.nan
    return float(total) / 1e6


@njit(cache=True, nogil=True)
def _time(b, i, e, num):
    """The time value at b[i] (a number, or a string of one or of an ISO time) as epoch seconds, with its end
    index; NaN where the exact path must read it."""
    c = b[i]
    if c == 0x22:
        j = _string(b, i, e)
        if j < 0:
            return np.nan, _FALLBACK
        if j - i > 2 and 0x30 <= b[i + 1] <= 0x39:
            k = _number(b, i + 1, j - 1, num)
            if k == j - 1:
                v = num[0]
            else:
                v = _iso(b, i + 1, j - 1)
        else:
            v = np.nan
    elif c == 0x2D or 0x30 <= c <= 0x39:
        j = _number(b, i, e, num)
        v = num[0]
    else:
        return np.nan, _FALLBACK
    if j < 0 or not (v >= 0) or v == np.inf:
        return np.nan, _FALLBACK
    return (v / 1000.0 if v > 1e11 else v), j


@njit(cache=True, nogil=True)
def _tokens(b, i, e, num):
    """A token count at b[i]: (value, end); null is NaN (unknown); anything the exact path must judge (a
    string, a bool, out of bounds) is end -1."""
    c = b[i]
    if c == 0x6E:
        j = _literal(b, i, e)
        return (np.nan, j) if j == i + 4 else (np.nan, _FALLBACK)
    if c == 0x2D or 0x30 <= c <= 0x39:
        j = _number(b, i, e, num)
        v = num[0]
        if j >= 0 and 0 <= v <= 1e7:
            return v, j
    return np.nan, _FALLBACK


@njit(cache=True, nogil=True)
def _usage(b, i, e, stack, num, tokens):
    """The ``usage`` object at b[i]: its prompt and completion token counts into tokens[2:4] (NaN: absent or
    null)."""
    tokens[2] = tokens[3] = np.nan
    j = _ws(b, i + 1, e)
    if j < e and b[j] == 0x7D:
        return j + 1
    i += 1
    while True:
        key, i = _member_key(b, i, e)
        if i < 0:
            return _FALLBACK
        if key == K_PROMPT or key == K_COMPLETION:
            v, i = _tokens(b, i, e, num)
            tokens[2 + key - K_PROMPT] = v
        else:
            i = _skip(b, i, e, stack, num)
        if i < 0:
            return _FALLBACK
        i = _ws(b, i, e)
        if i >= e:
            return _FALLBACK
        if b[i] == 0x7D:
            return i + 1
        if b[i] != 0x2C:
            return _FALLBACK
        i += 1


@njit(cache=True, nogil=True)
def _record(b, s, e, litellm, stack, num, times, model, tokens, rec):
    """The record on the line from b[s] (up to a newline or e) into rec: time, prompt tokens, completion tokens,
    the model's first and end byte. Returns 1 (a record) or 0 (a blank line) with the line's end, or _FALLBACK
    (the end unknown). times, model, tokens: work arrays."""
    i = _ws(b, s, e)
    if i == e or b[i] != 0x7B:
        while s < e and _BLANK[b[s]]:
            s += 1
        return (0, s) if s == e or b[s] == 0x0A else (_FALLBACK, -1)
    for k in range(times.size):  # element by element: a slice is a new array each line
        times[k] = np.nan  # per time key (NaN: absent)
    model[0] = model[1] = model[2] = model[3] = -1  # model's start, end; model_group's (start -2: null)
    tokens[0] = tokens[1] = -1.0  # prompt, completion at top level (-1: absent, NaN: null)
    tokens[2] = tokens[3] = np.nan  # in usage (NaN: absent or null)
    i += 1
    while True:
        key, i = _member_key(b, i, e)
        if i < 0:
            return _FALLBACK, -1
        if 0 <= key < len(TIME_KEYS) and (not litellm or key == START_TIME):
            v, i = _time(b, i, e, num)
            times[key] = v
        elif key == K_MODEL or (key == K_GROUP and litellm):
            slot = 2 * (key - K_MODEL)
            if b[i] == 0x22:
                j = _string(b, i, e)
                model[slot], model[slot + 1] = i + 1, j - 1
                i = j
            elif key == K_GROUP and _literal(b, i, e) == i + 4 and b[i] == 0x6E:
                model[slot] = -2
                i += 4
            else:
                return _FALLBACK, -1
        elif key == K_PROMPT or key == K_COMPLETION:
            v, i = _tokens(b, i, e, num)
            tokens[key - K_PROMPT] = v
        elif key == K_USAGE and b[i] == 0x7B:
            i = _usage(b, i, e, stack, num, tokens)
        else:
            if key == K_USAGE:
                tokens[2] = tokens[3] = np.nan  # not an object: no usage
            i = _skip(b, i, e, stack, num)
        if i < 0:
            return _FALLBACK, -1
        i = _ws(b, i, e)
        if i >= e:
            return _FALLBACK, -1
        if b[i] == 0x7D:
            break
        if b[i] != 0x2C:
            return _FALLBACK, -1
        i += 1
    i = _ws(b, i + 1, e)
    if i < e and b[i] != 0x0A:
        return _FALLBACK, -1
    t = np.nan
    for k in range(len(TIME_KEYS)):
        if not np.isnan(times[k]):
            t = times[k]
            break
    if np.isnan(t):
        return _FALLBACK, -1  # no time: the exact path says so
    if litellm and model[3] > model[2] >= 0:
        ms, me = model[2], model[3]
    else:
        ms, me = model[0], model[1]
    if me <= ms or ms < 0:
        return _FALLBACK, -1
    rec[0] = t
    for k in range(2):
        rec[1 + k] = tokens[2 + k] if tokens[k] == -1.0 else tokens[k]
    rec[3], rec[4] = ms, me
    return 1, i


@njit(cache=True, nogil=True)
def scan(b, pos, litellm, slots, hashes, start, length, store, state,
         out_id, out_t, out_p, out_c, out_off, fb_start, fb_end, counts):
    """Read the lines of b (whole lines) from byte ``pos``: records into out_* (their line's first byte in
    out_off), the lines the exact path must read into fb_start/fb_end; counts[0:2]: records and such lines
    written so far. Returns (status, the byte to resume at)."""
    stack = np.zeros(MAX_DEPTH, np.uint8)
    num = np.zeros(1)
    times = np.zeros(len(TIME_KEYS))
    model = np.zeros(4, np.int64)
    tokens = np.zeros(4)
    rec = np.zeros(5)
    n, nf = counts[0], counts[1]
    status = DONE
    while pos < b.size:
        if n == out_id.size or nf == fb_start.size:
            status = FULL
            break
        got, e = _record(b, pos, b.size, litellm, stack, num, times, model, tokens, rec)
        if got == _FALLBACK:
            e = pos
            while e < b.size and b[e] != 0x0A:
                e += 1
            fb_start[nf], fb_end[nf] = pos, e
            nf += 1
        elif got == 1:
            k = _lookup(b, np.int64(rec[3]), np.int64(rec[4]), slots, hashes, start, length, store, state)
            if k < 0:
                status = GROW
                break
            out_id[n] = k
            out_t[n], out_p[n], out_c[n] = rec[0], rec[1], rec[2]
            out_off[n] = pos
            n += 1
        pos = e + 1
    counts[0], counts[1] = n, nf
    return status, min(pos, b.size)
