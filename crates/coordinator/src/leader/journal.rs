//! What the leader keeps of each request it runs: its tail (every completion token so far,
//! and how it ended), which resumed streams read, and its journal entries, written in
//! order by one task per request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tessera_comm::proto::FinishReason;
use tokio::sync::{mpsc, watch};
use tracing::warn;

use super::{JOURNAL_TIMEOUT, now_ms};
use crate::engine::{TokenEvent, TokenStream};
use crate::error::CoordinatorError;
use crate::group::TokenSender;
use crate::replication::node::NodeHandle;
use crate::replication::state::{Command, Outcome, RequestId};

/// How a request's run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ending {
    Finished(FinishReason),
    /// Its client went away (the sequence was cancelled).
    Cancelled,
    /// Its group failed it (a fence, which names a rank): it ends in the journal, without
    /// a reason, like a cancelled request, so that it expires rather than stay open.
    Failed,
    /// Its stream ended without a verdict (this peer stopped leading, or is stopping): it
    /// stays open in the journal, for a leader to resume.
    Interrupted,
}

/// Every completion token of one request so far, and its end once known.
#[derive(Clone, Debug, Default)]
pub(super) struct Tail {
    pub tokens: Vec<u32>,
    pub end: Option<Ending>,
}

/// The tails of the requests this peer runs, by request id.
#[derive(Clone, Debug, Default)]
pub(super) struct Tails(Arc<Mutex<HashMap<RequestId, watch::Sender<Tail>>>>);

impl Tails {
    /// A new tail for `id`, holding `tokens` already; `None` when `id` has one.
    pub fn open(&self, id: &str, tokens: Vec<u32>) -> Option<watch::Sender<Tail>> {
        let mut tails = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if tails.contains_key(id) {
            return None;
        }
        let (tx, _) = watch::channel(Tail { tokens, end: None });
        tails.insert(id.to_string(), tx.clone());
        Some(tx)
    }

    /// The requests this peer runs.
    pub fn ids(&self) -> Vec<RequestId> {
        let tails = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        tails.keys().cloned().collect()
    }

    pub fn get(&self, id: &str) -> Option<watch::Receiver<Tail>> {
        let tails = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        tails.get(id).map(watch::Sender::subscribe)
    }

    fn remove(&self, id: &str) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id);
    }
}

/// What a request's pump tells its journal writer.
#[derive(Debug)]
pub(super) enum JournalEvent {
    Token(u32),
    End(Ending),
}

/// Moves a request's tokens from its group into its tail and journal and, when it has a
/// client on this peer, to that client; a client that goes away cancels the sequence
/// (dropping `inner`). Without a client (a resumed request) it runs to the end.
pub(super) async fn pump(
    mut inner: TokenStream,
    tail: watch::Sender<Tail>,
    journal: mpsc::UnboundedSender<JournalEvent>,
    client: Option<TokenSender>,
) {
    let ending = loop {
        let gone = async {
            match &client {
                Some(tx) => tx.closed().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            event = inner.recv() => match event {
                Some(Ok(event)) => {
                    let (token, finish) = (event.token, event.finish);
                    let ending = finish.map(Ending::Finished);
                    tail.send_modify(|t| {
                        t.tokens.push(token);
                        t.end = t.end.or(ending);
                    });
                    let _ = journal.send(JournalEvent::Token(token));
                    if let Some(tx) = &client
                        && tx.send(Ok(event)).is_err()
                    {
                        break ending.unwrap_or(Ending::Cancelled);
                    }
                    if let Some(ending) = ending {
                        break ending;
                    }
                }
                Some(Err(error)) => {
                    let ending = if error.rank.is_some() {
                        Ending::Failed
                    } else {
                        Ending::Interrupted
                    };
                    if let Some(tx) = &client {
                        let _ = tx.send(Err(error));
                    }
                    break ending;
                }
                None => break Ending::Interrupted,
            },
            () = gone => break Ending::Cancelled,
        }
    };
    tail.send_modify(|t| t.end = t.end.or(Some(ending)));
    let _ = journal.send(JournalEvent::End(ending));
}

/// A stream of every token of a tail from the first on: those it holds at once, then
/// each as it comes; the last carries the finish. A tail that ends unfinished ends the
/// stream with an error.
pub(super) fn follow(mut tail: watch::Receiver<Tail>) -> TokenStream {
    let (tx, stream) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut sent = 0;
        loop {
            let (tokens, end) = {
                let now = tail.borrow_and_update();
                (now.tokens[sent.min(now.tokens.len())..].to_vec(), now.end)
            };
            let last = tokens.len().checked_sub(1);
            for (i, token) in tokens.into_iter().enumerate() {
                let finish = match end {
                    Some(Ending::Finished(reason)) if Some(i) == last => Some(reason),
                    _ => None,
                };
                if tx
                    .send(Ok(TokenEvent {
                        token,
                        logprobs: None,
                        finish,
                    }))
                    .is_err()
                {
                    return;
                }
                sent += 1;
            }
            match end {
                // An interrupted run (or a tail dropped without an end: this peer stopped)
                // ends the stream without a finish, which the API tells the client as an
                // interruption to fetch again: the request stays open for a leader.
                Some(Ending::Finished(_) | Ending::Interrupted) => return,
                Some(ending) => {
                    let ending = format!("{ending:?}");
                    let error = CoordinatorError::EndedUnfinished { ending };
                    let _ = tx.send(Err(error.into()));
                    return;
                }
                None => {
                    if tail.changed().await.is_err() && tail.borrow().end.is_none() {
                        return;
                    }
                }
            }
        }
    });
    TokenStream::new(stream)
}

/// Records one request's tokens and end in the journal, in order, starting after the
/// `recorded` tokens it holds already. While one checkpoint commits, the next tokens
/// gather, so checkpoints batch by the commit latency. An interrupted request gets no
/// `Finish`: it stays open for a leader to resume (or until its time to live passes).
/// Its tail is dropped at the end.
pub(super) async fn write(
    node: NodeHandle,
    id: RequestId,
    recorded: Vec<u32>,
    mut events: mpsc::UnboundedReceiver<JournalEvent>,
    tails: Tails,
) {
    let mut recorded_len = recorded.len();
    let mut tokens = recorded;
    let mut end: Option<Ending> = None;
    while end.is_none() {
        let first = events.recv().await;
        if first.is_none() {
            end = Some(Ending::Interrupted);
        }
        for event in first
            .into_iter()
            .chain(std::iter::from_fn(|| events.try_recv().ok()))
        {
            match event {
                JournalEvent::Token(t) => tokens.push(t),
                JournalEvent::End(ending) => end = Some(ending),
            }
        }
        if tokens.len() > recorded_len {
            let progress = Command::Progress {
                id: id.clone(),
                offset: recorded_len as u32,
                tokens: tokens[recorded_len..].to_vec(),
            };
            match node.propose(progress, JOURNAL_TIMEOUT).await {
                Ok(applied) => match applied.outcome {
                    Outcome::Applied => recorded_len = tokens.len(),
                    // Out of step after a lost checkpoint: go on from what is recorded.
                    Outcome::BadProgress { recorded: r } if (r as usize) <= tokens.len() => {
                        recorded_len = r as usize;
                    }
                    other => warn!(request = %id, outcome = ?other, "checkpoint refused"),
                },
                Err(error) => warn!(request = %id, %error, "checkpoint not committed"),
            }
        }
    }
    let reason = match end {
        Some(Ending::Finished(reason)) => Some(Some(reason)),
        Some(Ending::Cancelled | Ending::Failed) => Some(None),
        Some(Ending::Interrupted) | None => None,
    };
    if let Some(reason) = reason {
        let finish = Command::Finish {
            id: id.clone(),
            reason,
            at_ms: now_ms(),
        };
        if let Err(error) = node.propose(finish, JOURNAL_TIMEOUT).await {
            warn!(request = %id, %error, "completion not journaled");
        }
    }
    tails.remove(&id);
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use raft::prelude::Message;
    use tessera_comm::proto::Sampling;
    use tessera_topology::PeerId;

    use super::*;
    use crate::engine::GenerateRequest;
    use crate::replication::node::{self, Transport};
    use crate::replication::peer::Peer;
    use crate::replication::store::LogStore;
    use crate::replication::{log, state::Journaled};

    /// A lone peer needs no one to talk to.
    struct Nowhere;

    impl Transport for Nowhere {
        fn send(&mut self, _message: Message) {}
    }

    async fn journaled_after(ending: Ending) -> Journaled {
        let store = LogStore::in_memory("journal").expect("store");
        let peer = Peer::start(PeerId(1), &[PeerId(1)], store, 1, &log::discard()).expect("peer");
        let node = node::spawn(peer, Nowhere).expect("thread");
        let request = GenerateRequest {
            model: "m".into(),
            prompt: vec![1, 2, 3],
            max_tokens: 8,
            sampling: Sampling::default(),
            stop_token_ids: vec![2],
            stop: Vec::new(),
            priority: 0,
        };
        let accept = Command::Accept {
            id: "r".into(),
            request,
            at_ms: 1,
        };
        let wait = Duration::from_secs(5);
        let applied = node.propose(accept, wait).await.expect("accepted");
        assert_eq!(applied.outcome, Outcome::Applied);
        let (events, rx) = mpsc::unbounded_channel();
        let _ = events.send(JournalEvent::Token(7));
        let _ = events.send(JournalEvent::End(ending));
        write(node.clone(), "r".into(), Vec::new(), rx, Tails::default()).await;
        let entry = node
            .read(|s| s.journal["r"].clone())
            .await
            .expect("running");
        tokio::task::spawn_blocking(move || node.stop())
            .await
            .expect("stopped");
        entry
    }

    /// A request its group failed ends in the journal (it expires with the finished
    /// ones); before, it stayed open for good, and a later leader ran it again.
    #[tokio::test]
    async fn a_failed_request_ends_in_the_journal_and_an_interrupted_one_stays_open() {
        let failed = journaled_after(Ending::Failed).await;
        assert_eq!(failed.sent, [7]);
        assert!(matches!(failed.finished, Some((None, _))), "{failed:?}");
        let interrupted = journaled_after(Ending::Interrupted).await;
        assert_eq!(interrupted.sent, [7]);
        assert_eq!(interrupted.finished, None);
    }
}
