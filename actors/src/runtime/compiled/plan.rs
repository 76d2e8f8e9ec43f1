//! A stream lowered once for running it again and again: every value it names gets a slot in a
//! table reused by every iteration (no map, no hashing of names per run), every send its route
//! and codec resolved ([`Port`]), every call its invoker, and every read says whether it is the
//! value's last in the stream — a last read moves the value out, so a value nothing else holds
//! is moved into the next message instead of copied. A plan has one step per instruction (the
//! one interpreter, [`crate::interpret`], walks the stream and looks its steps up by index).

use std::collections::HashMap;

use archipelago_dataflow::{ComputeOp, Instruction, TensorId};

use super::interpreter::node_of;
use super::routes::{Outbox, Port};
use super::{GatherFn, Invoke, Shared};
use crate::runtime::CallError;

/// A value's place in the table, and whether this read is its last.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Read {
    slot: usize,
    last: bool,
}

/// One instruction, resolved.
pub(crate) enum Step {
    /// Waits for a value from participant `from` on `tag`; `counter` numbers the distinct
    /// `(from, tag)` pairs of the stream (the program's own stream counts unclaimed values).
    Recv {
        slot: usize,
        from: usize,
        tag: u64,
        counter: usize,
    },
    /// Calls recorded node `node` on the input (`invoke` is `None` when this stream has no
    /// handler for it).
    Call {
        node: usize,
        input: Read,
        output: usize,
        invoke: Option<Invoke>,
    },
    /// Sends a value.
    Send { value: Read, tag: u64, port: Port },
    /// Gathers values into one `Vec` (the program's own stream).
    Gather {
        inputs: Vec<Read>,
        output: usize,
        gather: Option<GatherFn>,
    },
    /// The run's output (the program's own stream).
    Return { value: Read },
    /// A value under another name (a member's value entering a collective under the name every
    /// member gives it).
    Alias { input: Read, output: usize },
    /// A collective over the value in `slot` with `group` (this stream's actor is `me`; `None`
    /// when the stream has no group for its tag), its result put back there.
    Collective {
        slot: usize,
        kind: archipelago_dataflow::CollectiveKind,
        group: Option<crate::runtime::CollectiveGroup>,
        me: archipelago_dataflow::ActorId,
    },
    /// Nothing to do here (a collective's wait, the program's input, an unknown compute).
    Skip,
}

/// A lowered stream and the size of its table.
pub(crate) struct Plan {
    pub(crate) steps: Vec<Step>,
    pub(crate) slots: usize,
    /// The distinct `(from, tag)` pairs its receives wait on.
    pub(crate) counters: usize,
    /// The slot of the program's input (`input`), when the stream reads it.
    pub(crate) input: Option<usize>,
}

/// What a stream's calls, gathers and collectives resolve to.
pub(crate) struct Resolve<'a> {
    pub(crate) invokers: Option<&'a HashMap<usize, Invoke>>,
    pub(crate) gathers: Option<&'a HashMap<String, GatherFn>>,
    pub(crate) collectives: Option<&'a StreamCollectives>,
}

/// The collective groups of one participant's stream, by the tag of their collective, and the
/// participant's actor.
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamCollectives {
    pub(crate) me: archipelago_dataflow::ActorId,
    pub(crate) groups: HashMap<u64, crate::runtime::CollectiveGroup>,
}

/// The reads of each value still to come while a stream is lowered (a read that leaves none is
/// the value's last).
struct Reads<'a> {
    remaining: HashMap<&'a TensorId, usize>,
}

impl<'a> Reads<'a> {
    fn new(stream: &'a [Instruction]) -> Reads<'a> {
        let mut remaining: HashMap<&TensorId, usize> = HashMap::new();
        for instruction in stream {
            for tensor in instruction.reads() {
                *remaining.entry(tensor).or_default() += 1;
            }
        }
        Reads { remaining }
    }

    /// The next read of `tensor`, in stream order.
    fn read(&mut self, slots: &mut Slots<'a>, tensor: &'a TensorId) -> Read {
        let left = self.remaining.entry(tensor).or_default();
        *left = left.saturating_sub(1);
        Read {
            slot: slots.of(tensor),
            last: *left == 0,
        }
    }
}

/// Slots by value name, assigned in order of first mention.
#[derive(Default)]
struct Slots<'a> {
    index: HashMap<&'a TensorId, usize>,
}

impl<'a> Slots<'a> {
    fn of(&mut self, tensor: &'a TensorId) -> usize {
        let next = self.index.len();
        *self.index.entry(tensor).or_insert(next)
    }
}

impl Plan {
    /// Lowers `stream`, its sends going out through `outbox`.
    pub(crate) fn lower(stream: &[Instruction], outbox: &Outbox, resolve: Resolve) -> Plan {
        let (mut slots, mut reads) = (Slots::default(), Reads::new(stream));
        let mut counters: HashMap<(usize, u64), usize> = HashMap::new();
        let mut steps = Vec::with_capacity(stream.len());
        for instruction in stream {
            let step = match instruction {
                Instruction::Recv { tensor, from, tag } => {
                    let next = counters.len();
                    let counter = *counters.entry((*from, *tag)).or_insert(next);
                    let (slot, from, tag) = (slots.of(tensor), *from, *tag);
                    Step::Recv {
                        slot,
                        from,
                        tag,
                        counter,
                    }
                }
                Instruction::Send { tensor, to, tag } => Step::Send {
                    value: reads.read(&mut slots, tensor),
                    tag: *tag,
                    port: outbox.port(tensor, *to),
                },
                Instruction::Compute { op, inputs, outputs } => {
                    compute(op, inputs, outputs, &mut slots, &mut reads, &resolve).unwrap_or(Step::Skip)
                }
                Instruction::StartCollective {
                    kind, tensor, tag, ..
                } => {
                    reads.read(&mut slots, tensor);
                    Step::Collective {
                        slot: slots.of(tensor),
                        kind: *kind,
                        group: resolve.collectives.and_then(|c| c.groups.get(tag)).cloned(),
                        me: resolve.collectives.map_or(0, |c| c.me),
                    }
                }
                Instruction::WaitCollective { .. } => Step::Skip,
            };
            steps.push(step);
        }
        let input = slots.index.get(&TensorId::named("input")).copied();
        Plan {
            steps,
            slots: slots.index.len(),
            counters: counters.len(),
            input,
        }
    }
}

/// A stream of the direct path's shape: one receive, one call on the received value (read by
/// nothing else), and sends of the call's reply only.
pub(crate) struct Shape {
    pub(crate) from: usize,
    pub(crate) tag: u64,
    /// The reply's sends: tag and port, in stream order.
    pub(crate) onward: Vec<(u64, Port)>,
}

impl Plan {
    /// The call of a plan of the [`Shape`]; `None` for any other plan.
    pub(crate) fn shape_node(&self) -> Option<usize> {
        let steps: Vec<&Step> = self.steps.iter().filter(|s| !matches!(s, Step::Skip)).collect();
        let [
            Step::Recv { slot, .. },
            Step::Call {
                node,
                input,
                output,
                invoke: Some(_),
            },
            sends @ ..,
        ] = steps.as_slice()
        else {
            return None;
        };
        let sends_reply = |s: &&Step| matches!(s, Step::Send { value, .. } if value.slot == *output);
        ((input.slot, input.last) == (*slot, true) && sends.iter().all(sends_reply)).then_some(*node)
    }

    /// The plan as a [`Shape`], when it has that shape (itself otherwise).
    pub(crate) fn into_shape(self) -> Result<Shape, Plan> {
        if self.shape_node().is_none() {
            return Err(self);
        }
        let Some(&Step::Recv { from, tag, .. }) = self.steps.iter().find(|s| !matches!(s, Step::Skip)) else {
            return Err(self);
        };
        let onward = (self.steps.into_iter())
            .filter_map(|s| match s {
                Step::Send { tag, port, .. } => Some((tag, port)),
                _ => None,
            })
            .collect();
        Ok(Shape { from, tag, onward })
    }
}

/// A recorded call (`node:{i}`), a gather or the return; `None` for any other compute (the
/// program's `input`, which the run puts in its slot).
fn compute<'a>(
    op: &ComputeOp,
    inputs: &'a [TensorId],
    outputs: &'a [TensorId],
    slots: &mut Slots<'a>,
    reads: &mut Reads<'a>,
    resolve: &Resolve,
) -> Option<Step> {
    let ComputeOp::User { name } = op else {
        return None;
    };
    if let Some(node) = node_of(op) {
        let (input, output) = (inputs.first()?, outputs.first()?);
        let input = reads.read(slots, input);
        let invoke = resolve.invokers.and_then(|i| i.get(&node)).cloned();
        return Some(Step::Call {
            node,
            input,
            output: slots.of(output),
            invoke,
        });
    }
    match name.as_str() {
        "gather" => {
            let output = outputs.first()?;
            let inputs = inputs.iter().map(|i| reads.read(slots, i)).collect();
            let name = super::routes::value_name(output);
            let gather = resolve.gathers.and_then(|g| g.get(name)).copied();
            let output = slots.of(output);
            Some(Step::Gather {
                inputs,
                output,
                gather,
            })
        }
        "return" => Some(Step::Return {
            value: reads.read(slots, inputs.first()?),
        }),
        "alias" => Some(Step::Alias {
            input: reads.read(slots, inputs.first()?),
            output: slots.of(outputs.first()?),
        }),
        "input" => {
            slots.of(outputs.first()?);
            None
        }
        _ => None,
    }
}

/// A run's values, by slot: reused from one run to the next.
pub(crate) struct Table {
    values: Vec<Option<Result<Shared, CallError>>>,
}

impl Table {
    pub(crate) fn new(slots: usize) -> Table {
        Table {
            values: (0..slots).map(|_| None).collect(),
        }
    }

    /// The value `read` names (moved out on its last read), `None` if it never came.
    pub(crate) fn read(&mut self, read: Read) -> Option<Result<Shared, CallError>> {
        let value = self.values.get_mut(read.slot)?;
        if read.last { value.take() } else { value.clone() }
    }

    /// The value in `slot`, moved out.
    pub(crate) fn take(&mut self, slot: usize) -> Option<Result<Shared, CallError>> {
        self.values.get_mut(slot)?.take()
    }

    pub(crate) fn put(&mut self, slot: usize, value: Result<Shared, CallError>) {
        if let Some(place) = self.values.get_mut(slot) {
            *place = Some(value);
        }
    }

    /// Forgets every value (the end of a run).
    pub(crate) fn clear(&mut self) {
        self.values.iter_mut().for_each(|v| *v = None);
    }
}
