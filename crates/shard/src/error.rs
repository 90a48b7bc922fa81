//! Errors of the shard process, each with the class the coordinator sees.

use tessera_comm::proto::{ErrorClass, StepId, WireError};
use tessera_comm::{CollectiveError, CommError};
use tessera_model::ModelError;
use tessera_topology::Rank;

#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("collective failed: {source}")]
    Collective {
        #[from]
        source: CollectiveError,
    },
    #[error("model: {source}")]
    Model {
        #[from]
        source: ModelError,
    },
    /// A model version this group cannot slice (tp does not divide its heads, say).
    #[error("model version {version}: {message}")]
    Version { version: u32, message: String },
    #[error("step {step}: {message}")]
    BadPlan { step: StepId, message: String },
    #[error("no assignment yet: a step plan arrived before `Assign`")]
    NotAssigned,
    /// The control connection's framing, TLS or QUIC endpoint.
    #[error("control connection: {source}")]
    Comm {
        #[from]
        source: CommError,
    },
    #[error("connection to the coordinator: {source}")]
    Connection {
        #[from]
        source: quinn::ConnectionError,
    },
    #[error("cannot resolve the coordinator address {addr}")]
    Resolve { addr: String },
    /// A refusal (another protocol version, an identity the topology does not know):
    /// retrying would not change it.
    #[error("the coordinator refused this shard: {message}")]
    Refused { message: String },
    /// The compute thread is gone (the process is shutting down).
    #[error("the compute thread stopped")]
    ComputeStopped,
    /// Fault injection for tests (`TESSERA_FAULT_STEP_ERROR_FILE`): the model served holds
    /// the planted file, so its every step fails.
    #[error("fault injection: {file} is planted in the model, so every step fails")]
    PlantedFault { file: String },
}

impl ShardError {
    pub fn class(&self) -> ErrorClass {
        match self {
            ShardError::Collective { .. } => ErrorClass::Unavailable,
            ShardError::Model { source } => source.class(),
            ShardError::Comm { source } => source.class(),
            ShardError::Connection { .. } | ShardError::Resolve { .. } => ErrorClass::Unavailable,
            ShardError::BadPlan { .. }
            | ShardError::Version { .. }
            | ShardError::NotAssigned
            | ShardError::Refused { .. }
            | ShardError::ComputeStopped
            | ShardError::PlantedFault { .. } => ErrorClass::Internal,
        }
    }

    /// The collective failure inside this error, if that is what it is.
    fn collective(&self) -> Option<&CollectiveError> {
        match self {
            ShardError::Collective { source }
            | ShardError::Model {
                source: ModelError::Collective { source },
            } => Some(source),
            _ => None,
        }
    }

    /// The error as it crosses to the coordinator. A collective names the rank that did
    /// not arrive (or that aborted the group); any other failure is this rank's own.
    pub fn to_wire(&self, me: Rank) -> WireError {
        let rank = match self.collective() {
            Some(c) => c.culprit().or(Some(me)),
            None => Some(me),
        };
        WireError {
            class: self.class(),
            message: self.to_string(),
            rank,
        }
    }
}
