//! Validation of `[[group]]` entries and their `[[group.shard]]` entries: names, model
//! references, tp against the shard entries and their ranks, devices, and the collective
//! backend (`auto` resolved here).

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;

use toml::Spanned;

use super::{Bind, GpuUse, Hosts, Listener, Models, Validator};
use crate::error::TopologyError;
use crate::spec::{GroupSpec, ShardSpec, SizeSpec};
use crate::topology::{
    Collective, CollectiveChoice, Device, Group, ModelDtype, Precision, Rank, Shard,
};
use crate::units::{parse_device, parse_size};

/// A shard entry that passed its own checks, with the spans the group checks need.
struct ShardEntry {
    /// Position among the group's shard entries.
    index: usize,
    shard: Shard,
    device_span: Range<usize>,
}

impl Validator<'_> {
    pub(super) fn groups(
        &mut self,
        specs: &[Spanned<GroupSpec>],
        hosts: &Hosts,
        models: &Models,
    ) -> Vec<Group> {
        let mut seen = HashMap::new();
        let mut groups = Vec::new();
        for (i, entry) in specs.iter().enumerate() {
            if let Some(group) = self.group(i, entry, hosts, models, &mut seen) {
                groups.push(group);
            }
        }
        groups
    }

    fn group(
        &mut self,
        i: usize,
        entry: &Spanned<GroupSpec>,
        hosts: &Hosts,
        models: &Models,
        seen: &mut HashMap<String, usize>,
    ) -> Option<Group> {
        let (span, spec) = (entry.span(), entry.get_ref());
        let table = format!("group[{i}]");
        let name = self.required(&spec.name, &span, &table, "name");
        let name = self.unique_name(name, "group", &table, seen);
        let label = name.clone().unwrap_or_else(|| table.clone());
        let model = self
            .required(&spec.model, &span, &table, "model")
            .and_then(|m| self.model_ref(m, &label, &table, models));
        let tp = self
            .required(&spec.tp, &span, &table, "tp")
            .and_then(|tp| match usize::try_from(*tp.get_ref()) {
                Ok(value @ 1..) => Some(value),
                _ => {
                    let error = TopologyError::TpRange {
                        group: label.clone(),
                        tp: *tp.get_ref(),
                    };
                    self.error(tp.span(), format!("{table}.tp"), error);
                    None
                }
            });
        let requested = match &spec.collective {
            None => Some(CollectiveChoice::Auto),
            Some(c) => self.collective_choice(c, &label, &table),
        };
        let precision = match &spec.precision {
            None => Some(Precision::Exact),
            Some(p) => self.precision(p, &label, &table),
        };
        // Ranks that move their collectives through host memory may share a GPU (tp > 1
        // on one GPU, for tests); NCCL refuses two ranks on one device.
        let host_collective = matches!(
            requested,
            Some(CollectiveChoice::Shm | CollectiveChoice::Tcp)
        );
        let shards: Vec<Option<ShardEntry>> = (spec.shard.iter().enumerate())
            .map(|(j, s)| self.shard(j, (&table, &label, host_collective), s, hosts))
            .collect();
        let complete = !self.notes.is_incomplete_group(&span);
        if let (Some(tp), Some(tp_spec)) = (tp, &spec.tp) {
            self.ranks(&label, &table, tp, tp_spec.span(), &spec.shard, complete);
        }
        let valid: Vec<&ShardEntry> = shards.iter().flatten().collect();
        let collective_span = spec.collective.as_ref().map_or(span.clone(), Spanned::span);
        let collective =
            requested.and_then(|r| self.collective(&label, &table, r, collective_span, &valid));
        if let (Some(model), Some(spec_model)) = (&model, &spec.model) {
            self.dtype_on_device(&label, &table, model, spec_model.span(), &valid, models);
        }
        let shards: Vec<ShardEntry> = shards.into_iter().collect::<Option<_>>()?;
        let (name, model, tp) = (name?, model?, tp?);
        let (requested, collective, precision) = (requested?, collective?, precision?);
        if !complete || shards.len() != tp {
            return None;
        }
        let mut shards: Vec<Shard> = shards.into_iter().map(|s| s.shard).collect();
        shards.sort_by_key(|s| s.rank);
        let tp_at = self
            .source
            .locate(spec.tp.as_ref().map_or(span, Spanned::span).start);
        Some(Group {
            name,
            model,
            tp,
            collective,
            requested_collective: requested,
            precision,
            shards,
            tp_at,
            index: i,
        })
    }

    fn model_ref(
        &mut self,
        value: &Spanned<String>,
        group: &str,
        table: &str,
        models: &Models,
    ) -> Option<String> {
        let name = value.get_ref();
        self.used_models.insert(name.clone());
        if models.valid.iter().any(|m| &m.name == name) {
            return Some(name.clone());
        }
        if !models.declared.contains(name) && !self.notes.is_failed_name("model", name) {
            let error = TopologyError::UnknownModel {
                group: group.to_owned(),
                name: name.clone(),
                known: models.valid.iter().map(|m| m.name.clone()).collect(),
            };
            self.error(value.span(), format!("{table}.model"), error);
        }
        None
    }

    fn collective_choice(
        &mut self,
        value: &Spanned<String>,
        group: &str,
        table: &str,
    ) -> Option<CollectiveChoice> {
        match value.get_ref().as_str() {
            "auto" => Some(CollectiveChoice::Auto),
            "shm" => Some(CollectiveChoice::Shm),
            "tcp" => Some(CollectiveChoice::Tcp),
            "nccl" => Some(CollectiveChoice::Nccl),
            other => {
                let error = TopologyError::BadCollective {
                    group: group.to_owned(),
                    value: other.to_owned(),
                };
                self.error(value.span(), format!("{table}.collective"), error);
                None
            }
        }
    }

    fn precision(
        &mut self,
        value: &Spanned<String>,
        group: &str,
        table: &str,
    ) -> Option<Precision> {
        match value.get_ref().as_str() {
            "exact" => Some(Precision::Exact),
            "fast" => Some(Precision::Fast),
            other => {
                let error = TopologyError::BadPrecision {
                    group: group.to_owned(),
                    value: other.to_owned(),
                };
                self.error(value.span(), format!("{table}.precision"), error);
                None
            }
        }
    }

    /// Ranks are exactly `0..tp`: each in range, none twice, and (when every shard entry
    /// could be read) `tp` entries in all.
    fn ranks(
        &mut self,
        group: &str,
        table: &str,
        tp: usize,
        tp_span: Range<usize>,
        shards: &[Spanned<ShardSpec>],
        complete: bool,
    ) {
        let mut seen: HashMap<i64, usize> = HashMap::new();
        for (j, shard) in shards.iter().enumerate() {
            let Some(rank) = &shard.get_ref().rank else {
                continue;
            };
            let value = *rank.get_ref();
            let field = format!("{table}.shard[{j}].rank");
            let in_range = usize::try_from(value).is_ok_and(|r| r < tp);
            if !in_range {
                let error = TopologyError::RankRange {
                    group: group.to_owned(),
                    rank: value,
                    tp,
                };
                self.error(rank.span(), field, error);
            } else if let Some(&first_line) = seen.get(&value) {
                let error = TopologyError::DuplicateRank {
                    group: group.to_owned(),
                    rank: value,
                    first_line,
                };
                self.error(rank.span(), field, error);
            } else {
                seen.insert(value, self.line(&rank.span()));
            }
        }
        if complete && shards.len() != tp {
            let missing = (0..tp)
                .filter(|r| i64::try_from(*r).is_ok_and(|r| !seen.contains_key(&r)))
                .collect();
            let error = TopologyError::ShardCount {
                group: group.to_owned(),
                tp,
                shards: shards.len(),
                missing,
            };
            self.error(tp_span, format!("{table}.tp"), error);
        }
    }

    /// One shard entry; records its listener and GPU for the cross-entry checks.
    /// Shard `index` of a group (its table, its name, whether its collective goes
    /// through host memory).
    fn shard(
        &mut self,
        index: usize,
        (group_table, group, host_collective): (&str, &str, bool),
        entry: &Spanned<ShardSpec>,
        hosts: &Hosts,
    ) -> Option<ShardEntry> {
        let (span, spec) = (entry.span(), entry.get_ref());
        let table = &format!("{group_table}.shard[{index}]");
        let rank = self.required(&spec.rank, &span, table, "rank");
        let rank = rank.and_then(|r| u32::try_from(*r.get_ref()).ok());
        let what = rank.map_or(table.to_owned(), |r| format!("group {group} rank {r}"));
        let host = self
            .required(&spec.host, &span, table, "host")
            .and_then(|h| self.host_ref(h, &what, format!("{table}.host"), hosts));
        let device = self.required(&spec.device, &span, table, "device");
        let device_span = device.map_or(span.clone(), Spanned::span);
        let device = device.and_then(|d| match parse_device(d.get_ref()) {
            Ok(device) => Some(device),
            Err(reason) => {
                let error = TopologyError::BadDevice {
                    what: what.clone(),
                    value: d.get_ref().clone(),
                    reason,
                };
                self.error(d.span(), format!("{table}.device"), error);
                None
            }
        });
        let threads = self.threads(spec, table, &what);
        let port = self.port(spec, &span, table, &what);
        let kv_memory_bytes = self
            .required(&spec.kv_memory, &span, table, "kv_memory")
            .and_then(|kv| self.kv_memory(kv, table, &what));
        if let (Some(host), Some(port)) = (host, port) {
            let port_span = spec.port.as_ref().map_or(span, Spanned::span);
            self.listeners.push(Listener {
                machine: host.address.clone(),
                host: host.name.clone(),
                bind: Bind::of(&host.address),
                port,
                owner: what.clone(),
                span: port_span,
                field: format!("{table}.port"),
            });
        }
        if let (Some(host), Some(Device::Cuda(index))) = (host, device) {
            self.gpus.push(GpuUse {
                machine: host.address.clone(),
                host: host.name.clone(),
                index,
                host_collective,
                owner: what,
                span: device_span.clone(),
                field: format!("{table}.device"),
            });
        }
        let (Some(rank), Some(host), Some(device), Some(threads), Some(port), Some(kv)) =
            (rank, host, device, threads, port, kv_memory_bytes)
        else {
            return None;
        };
        let shard = Shard {
            rank: Rank(rank),
            host: host.name.clone(),
            device,
            threads,
            port,
            kv_memory_bytes: kv,
        };
        Some(ShardEntry {
            index,
            shard,
            device_span,
        })
    }

    /// `threads`, default 1, at least 1.
    fn threads(&mut self, spec: &ShardSpec, table: &str, what: &str) -> Option<usize> {
        let Some(threads) = &spec.threads else {
            return Some(1);
        };
        match usize::try_from(*threads.get_ref()) {
            Ok(value @ 1..) => Some(value),
            _ => {
                let error = TopologyError::ThreadsRange {
                    what: what.to_owned(),
                    threads: *threads.get_ref(),
                };
                self.error(threads.span(), format!("{table}.threads"), error);
                None
            }
        }
    }

    fn port(
        &mut self,
        spec: &ShardSpec,
        entry: &Range<usize>,
        table: &str,
        what: &str,
    ) -> Option<u16> {
        let port = self.required(&spec.port, entry, table, "port")?;
        match u16::try_from(*port.get_ref()) {
            Ok(value @ 1..) => Some(value),
            _ => {
                let error = TopologyError::PortRange {
                    what: what.to_owned(),
                    port: *port.get_ref(),
                };
                self.error(port.span(), format!("{table}.port"), error);
                None
            }
        }
    }

    fn kv_memory(&mut self, value: &Spanned<SizeSpec>, table: &str, what: &str) -> Option<u64> {
        let field = format!("{table}.kv_memory");
        let parsed = match value.get_ref() {
            SizeSpec::Bytes(n) => u64::try_from(*n).map_err(|_| "it is negative".to_string()),
            SizeSpec::Text(text) => parse_size(text),
        };
        match parsed {
            Ok(0) => {
                let error = TopologyError::ZeroKvMemory {
                    what: what.to_owned(),
                };
                self.error(value.span(), field, error);
                None
            }
            Ok(bytes) => Some(bytes),
            Err(reason) => {
                let error = TopologyError::BadSize {
                    what: what.to_owned(),
                    value: value.get_ref().to_string(),
                    reason,
                };
                self.error(value.span(), field, error);
                None
            }
        }
    }

    /// Cuda shards hold weights in bf16 (the quantized types their matvecs read kept so) or, on the
    /// exact path, f32: a model whose `dtype` asks for f16 cannot run there.
    fn dtype_on_device(
        &mut self,
        group: &str,
        table: &str,
        model: &str,
        span: Range<usize>,
        shards: &[&ShardEntry],
        models: &Models,
    ) {
        let Some(m) = models.valid.iter().find(|m| m.name == model) else {
            return;
        };
        let on_cuda = shards.iter().any(|s| s.shard.device.is_cuda());
        if on_cuda && m.dtype == ModelDtype::F16 {
            let error = TopologyError::DtypeOnCuda {
                group: group.to_owned(),
                model: model.to_owned(),
                dtype: m.dtype.as_str().to_owned(),
            };
            self.error(span, format!("{table}.model"), error);
        }
    }

    /// One kind of device per group, and a collective that suits it (`auto` resolved:
    /// nccl on cuda, shm for cpu on one host, tcp for cpu across hosts).
    fn collective(
        &mut self,
        group: &str,
        table: &str,
        requested: CollectiveChoice,
        span: Range<usize>,
        shards: &[&ShardEntry],
    ) -> Option<Collective> {
        let first = *shards.first()?;
        let cuda = first.shard.device.is_cuda();
        if let Some(&other) = shards.iter().find(|s| s.shard.device.is_cuda() != cuda) {
            let (cpu, gpu) = if cuda { (other, first) } else { (first, other) };
            let error = TopologyError::MixedDevices {
                group: group.to_owned(),
                cpu_rank: cpu.shard.rank.0,
                cuda_rank: gpu.shard.rank.0,
            };
            let field = format!("{table}.shard[{}].device", other.index);
            self.error(other.device_span.clone(), field, error);
            return None;
        }
        let hosts: BTreeSet<&str> = shards.iter().map(|s| s.shard.host.as_str()).collect();
        let field = format!("{table}.collective");
        let error = match (requested, cuda) {
            (CollectiveChoice::Auto, true) => return Some(Collective::Nccl),
            (CollectiveChoice::Auto, false) if hosts.len() == 1 => return Some(Collective::Shm),
            (CollectiveChoice::Auto, false) => return Some(Collective::Tcp),
            (CollectiveChoice::Nccl, true) => return Some(Collective::Nccl),
            (CollectiveChoice::Nccl, false) => TopologyError::NcclOnCpu {
                group: group.to_owned(),
            },
            // On cuda shards the CPU collectives stage through host memory (device → host
            // → ring → device): slower than NCCL, but needs no NCCL.
            (CollectiveChoice::Shm, _) if hosts.len() == 1 => return Some(Collective::Shm),
            (CollectiveChoice::Shm, _) => TopologyError::ShmAcrossHosts {
                group: group.to_owned(),
                hosts: hosts.iter().map(|h| (*h).to_owned()).collect(),
            },
            (CollectiveChoice::Tcp, _) => return Some(Collective::Tcp),
        };
        self.error(span, field, error);
        None
    }
}
