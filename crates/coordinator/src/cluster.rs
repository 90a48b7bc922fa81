//! The coordinator's view of the cluster: every group's handle, by model, and the
//! [`Engine`] the HTTP API calls — it routes a request to a group of its model.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use tessera_comm::proto::{ErrorClass, WireError};
use tessera_topology::{Collective, Topology};

use crate::engine::{BoxFuture, ClusterStatus, Engine, GenerateRequest, GroupStatus, TokenStream};
use crate::group::GroupHandle;
use crate::group::driver::{self, GroupConfig, Limits};

/// Every group of the topology, with a running driver each.
#[derive(Clone, Debug)]
pub struct Cluster {
    groups: Arc<BTreeMap<String, GroupHandle>>,
}

impl Cluster {
    /// Starts one driver per group of `topology`. Must run inside a tokio runtime.
    pub fn start(topology: &Topology, term: u64, limits: Limits) -> Cluster {
        let seq_ids = Arc::new(AtomicU64::new(1));
        let groups = topology
            .groups
            .iter()
            .map(|g| {
                let tcp_peers = (g.collective == Collective::Tcp).then(|| {
                    g.shards
                        .iter()
                        .map(|s| {
                            let address = topology
                                .host(&s.host)
                                .map_or(s.host.as_str(), |h| h.address.as_str());
                            if address.contains(':') {
                                format!("[{address}]:{}", s.port)
                            } else {
                                format!("{address}:{}", s.port)
                            }
                        })
                        .collect()
                });
                let config = GroupConfig {
                    name: g.name.clone(),
                    model: g.model.clone(),
                    tp: g.tp,
                    tcp_peers,
                    term,
                    limits,
                };
                (g.name.clone(), driver::spawn(config, Arc::clone(&seq_ids)))
            })
            .collect();
        Cluster {
            groups: Arc::new(groups),
        }
    }

    pub fn group(&self, name: &str) -> Option<&GroupHandle> {
        self.groups.get(name)
    }

    /// A group for `model`: the first serving one, else the first one (the request then
    /// waits in its queue for the group to come up).
    fn route(&self, model: &str) -> Option<&GroupHandle> {
        let mut of_model = self.groups.values().filter(|g| g.model == model);
        let first = of_model.clone().next();
        of_model.find(|g| g.is_ready()).or(first)
    }
}

impl Engine for Cluster {
    fn generate(&self, request: GenerateRequest) -> BoxFuture<'_, Result<TokenStream, WireError>> {
        Box::pin(async move {
            let group = self.route(&request.model).ok_or_else(|| WireError {
                class: ErrorClass::InvalidRequest,
                message: format!("no group serves model `{}`", request.model),
                rank: None,
            })?;
            group.generate(request).await
        })
    }

    fn admission(&self, _model: &str) -> Result<(), WireError> {
        Ok(())
    }

    fn status(&self) -> ClusterStatus {
        ClusterStatus {
            groups: self
                .groups
                .values()
                .map(|g| GroupStatus {
                    name: g.name.clone(),
                    model: g.model.clone(),
                    tp: g.tp,
                    state: if g.is_ready() { "serving" } else { "down" },
                    ..GroupStatus::default()
                })
                .collect(),
        }
    }

    fn ready(&self, model: &str) -> bool {
        self.groups
            .values()
            .any(|g| g.model == model && g.is_ready())
    }
}
