"""Records for the policy loop: a named tuple's fields behind one plain pointer (no reference counting).

The loop's state is a few named tuples of arrays (``twin.policies.engine``). Numba passes a named
tuple by value: every call that takes one increments, and on return decrements, the reference count
of each of its arrays (an atomic operation each, and one LLVM argument per array field). With
records of a dozen arrays, a phase function call cost a hundred atomic operations and the loop of
small phase functions ran ~80x slower, and compiled ~4x slower, than one big function.

:func:`new_record` copies a named tuple's fields into one heap struct and returns a pointer to it,
a :class:`RecordType` value with the same attribute names and types (``rec.free[0] += 1``,
``rec.state[a]`` work as on the tuple). Passing a record costs one pointer and nothing else: numba
does not count references to it. Its lifetime is manual: the caller that makes it frees it with
:func:`free_records` once nothing uses it (what attribute reads returned, e.g. an array, stays
valid: it holds its own reference).
"""

from __future__ import annotations

from numba.core import cgutils, types
from numba.core.datamodel import models
from numba.core.extending import intrinsic, overload, register_model
from numba.experimental import structref


class RecordType(types.StructRef):
    """A struct with the fields of a named tuple, held by a pointer that numba does not count."""

    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(typ)) for name, typ in fields)


@register_model(RecordType)
class _RecordModel(models.StructModel):
    # structref's own model holds a MemInfoPointer (reference counted); a void pointer is not.
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, [("meminfo", types.voidptr)])


structref.define_attributes(RecordType)  # attribute reads and writes, as structref's


def new_record(tup):
    """A record with the fields of the named tuple ``tup`` (jitted code only; free it)."""
    raise NotImplementedError("new_record is for jitted code")


@overload(new_record)
def _new_record(tup):
    if not isinstance(tup, types.BaseNamedTuple):
        return None
    rtype = RecordType(list(zip(tup.fields, tup.types)))
    body = "".join(f"    rec.{name} = tup.{name}\n" for name in tup.fields)
    ns = {"new": structref.new, "rtype": rtype}
    exec(f"def impl(tup):\n    rec = new(rtype)\n{body}    return rec\n", ns)  # noqa: S102
    return ns["impl"]


@intrinsic
def free_records(typingctx, recs):
    """Free the records of the tuple ``recs`` (each releases the arrays it holds)."""
    if not isinstance(recs, types.BaseTuple) or not all(isinstance(t, RecordType) for t in recs):
        return None

    def codegen(context, builder, sig, args):
        for i, typ in enumerate(sig.args[0]):
            rec = cgutils.create_struct_proxy(typ)(context, builder, value=builder.extract_value(args[0], i))
            context.nrt.decref(builder, types.MemInfoPointer(types.voidptr), rec.meminfo)
        return context.get_dummy_value()

    return types.none(recs), codegen
