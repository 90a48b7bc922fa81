//! A linearizability checker for histories of operations on a sequential model
//! (Wing & Gong's search with Lowe's memoization, as in Porcupine and Knossos).
//!
//! A history lists each operation's call and return times (from one logical clock) with
//! its input and, once it returned, its output. An operation that never returned (its
//! proposer crashed, its leader was deposed) may have taken effect at any point after its
//! call, or never. The history is linearizable when some order of the operations respects
//! real time — an operation that returned before another was called comes first — and
//! replaying the inputs on the model in that order gives every returned output.
//!
//! The search tries, at each point, every operation that may come next (called before
//! every pending return), and memoizes (operations done, model state) pairs already
//! explored, so histories of a few hundred operations with a handful in flight at once
//! check in milliseconds. A search budget bounds the rest.

use std::collections::HashSet;

/// A sequential specification.
pub trait Model: Clone {
    type Input;
    type Output: PartialEq;
    /// Applies `input`, returning its output.
    fn step(&mut self, input: &Self::Input) -> Self::Output;
    /// A key equal for equal states (for memoization).
    fn key(&self) -> Vec<u8>;
}

/// One operation of a history.
#[derive(Clone, Debug)]
pub struct Operation<I, O> {
    pub call: u64,
    /// `None`: it never returned.
    pub ret: Option<u64>,
    pub input: I,
    /// The output it returned with; `None` when it never returned.
    pub output: Option<O>,
}

/// The checker's verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// A witness: the indices of the operations that took effect, in order.
    Linearizable(Vec<usize>),
    NotLinearizable,
    /// The search budget ran out first.
    Unknown,
}

/// States the search visits at most.
pub const DEFAULT_BUDGET: usize = 2_000_000;

/// Checks `history` against `model`, starting from its given state.
pub fn check<M: Model>(model: &M, history: &[Operation<M::Input, M::Output>]) -> Verdict {
    check_with_budget(model, history, DEFAULT_BUDGET)
}

/// [`check`] with a budget of visited states.
pub fn check_with_budget<M: Model>(
    model: &M,
    history: &[Operation<M::Input, M::Output>],
    budget: usize,
) -> Verdict {
    let mut search = Search {
        history,
        done: vec![false; history.len()],
        order: Vec::new(),
        seen: HashSet::new(),
        budget,
    };
    match search.explore(model) {
        Some(true) => Verdict::Linearizable(search.order),
        Some(false) => Verdict::NotLinearizable,
        None => Verdict::Unknown,
    }
}

struct Search<'h, I, O> {
    history: &'h [Operation<I, O>],
    done: Vec<bool>,
    order: Vec<usize>,
    seen: HashSet<(Vec<bool>, Vec<u8>)>,
    budget: usize,
}

impl<I, O: PartialEq> Search<'_, I, O> {
    /// `Some(true)` when the operations not done yet linearize after `model`'s state;
    /// `None` when the budget ran out.
    fn explore<M: Model<Input = I, Output = O>>(&mut self, model: &M) -> Option<bool> {
        // Every operation that returned is done: the rest never returned and may be
        // left out.
        let first_return = self
            .history
            .iter()
            .zip(&self.done)
            .filter(|(_, done)| !**done)
            .filter_map(|(op, _)| op.ret)
            .min();
        let Some(first_return) = first_return else {
            return Some(true);
        };
        if !self.seen.insert((self.done.clone(), model.key())) {
            return Some(false);
        }
        if self.budget == 0 {
            return None;
        }
        self.budget -= 1;
        for i in 0..self.history.len() {
            let op = &self.history[i];
            // Only an operation called before the first pending return can come next.
            if self.done[i] || op.call > first_return {
                continue;
            }
            let mut next = model.clone();
            let output = next.step(&op.input);
            if op.output.as_ref().is_some_and(|o| *o != output) {
                continue;
            }
            self.done[i] = true;
            self.order.push(i);
            match self.explore(&next) {
                Some(true) => return Some(true),
                Some(false) => {}
                None => return None,
            }
            self.done[i] = false;
            self.order.pop();
        }
        Some(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A register with compare-and-set, the classic model.
    #[derive(Clone, Debug, Default)]
    struct Register(u32);

    #[derive(Clone, Debug)]
    enum Op {
        Write(u32),
        Read,
        Cas(u32, u32),
    }

    impl Model for Register {
        type Input = Op;
        type Output = Option<u32>;
        fn step(&mut self, input: &Op) -> Option<u32> {
            match *input {
                Op::Write(v) => {
                    self.0 = v;
                    None
                }
                Op::Read => Some(self.0),
                Op::Cas(from, to) => {
                    let ok = self.0 == from;
                    if ok {
                        self.0 = to;
                    }
                    Some(u32::from(ok))
                }
            }
        }
        fn key(&self) -> Vec<u8> {
            self.0.to_le_bytes().to_vec()
        }
    }

    fn op(
        call: u64,
        ret: Option<u64>,
        input: Op,
        output: Option<u32>,
    ) -> Operation<Op, Option<u32>> {
        Operation {
            call,
            ret,
            input,
            output: ret.map(|_| output),
        }
    }

    #[test]
    fn concurrent_operations_may_take_effect_in_either_order() {
        // Write 1 and write 2 overlap; a later read sees 1: write 2 went first.
        let history = [
            op(0, Some(3), Op::Write(1), None),
            op(1, Some(2), Op::Write(2), None),
            op(4, Some(5), Op::Read, Some(1)),
        ];
        assert_eq!(
            check(&Register::default(), &history),
            Verdict::Linearizable(vec![1, 0, 2])
        );
    }

    #[test]
    fn a_stale_read_after_a_returned_write_is_caught() {
        let history = [
            op(0, Some(1), Op::Write(1), None),
            op(2, Some(3), Op::Read, Some(0)),
        ];
        assert_eq!(
            check(&Register::default(), &history),
            Verdict::NotLinearizable
        );
    }

    #[test]
    fn two_compare_and_sets_cannot_both_win() {
        let history = [
            op(0, Some(2), Op::Cas(0, 1), Some(1)),
            op(1, Some(3), Op::Cas(0, 2), Some(1)),
        ];
        assert_eq!(
            check(&Register::default(), &history),
            Verdict::NotLinearizable
        );
    }

    #[test]
    fn an_operation_that_never_returned_may_or_may_not_have_happened() {
        let lost = op(0, None, Op::Write(5), None);
        let saw_it = [lost.clone(), op(1, Some(2), Op::Read, Some(5))];
        assert!(matches!(
            check(&Register::default(), &saw_it),
            Verdict::Linearizable(_)
        ));
        let did_not = [lost, op(1, Some(2), Op::Read, Some(0))];
        assert_eq!(
            check(&Register::default(), &did_not),
            Verdict::Linearizable(vec![1])
        );
        // But it cannot take effect before it was called.
        let before = [
            op(0, Some(1), Op::Read, Some(5)),
            op(2, None, Op::Write(5), None),
        ];
        assert_eq!(
            check(&Register::default(), &before),
            Verdict::NotLinearizable
        );
    }

    #[test]
    fn the_budget_bounds_the_search() {
        let history: Vec<_> = (0..12)
            .map(|i| op(0, Some(100), Op::Write(i), None))
            .chain([op(101, Some(102), Op::Read, Some(99))])
            .collect();
        assert_eq!(
            check_with_budget(&Register::default(), &history, 50),
            Verdict::Unknown
        );
    }
}
