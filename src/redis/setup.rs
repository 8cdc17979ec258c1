//! A check of the deployment: is every node a primary of its own?

use std::fmt;
use std::time::Duration;

use futures_util::future::join_all;

use super::node::Node;

/// What one server says about itself (`INFO`'s `server` and `replication`
/// sections).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NodeStatus {
    /// `host:port/db` of the node, as configured (no credentials).
    pub node: String,
    /// The server's `run_id`, which differs for every running server process.
    pub run_id: Option<String>,
    /// `master` or `slave` (a replica).
    pub role: Option<String>,
    /// The primary a replica follows (`master_host:master_port`).
    pub primary: Option<String>,
    /// How many replicas follow this server.
    pub connected_replicas: u64,
    /// Whether the server keeps an append-only file (`aof_enabled`), the
    /// only persistence that can keep a lock and a fencing counter across a
    /// restart (an RDB snapshot is minutes old). `None` if not reported.
    pub append_only: Option<bool>,
    /// The memory limit in bytes (`maxmemory`; 0: none). `None` if not
    /// reported.
    pub max_memory: Option<u64>,
    /// What the server deletes once it reaches `maxmemory`
    /// (`maxmemory_policy`). `None` if not reported.
    pub eviction_policy: Option<String>,
    /// Why the node could not be asked, if it could not.
    pub error: Option<String>,
}

/// A finding that makes a deployment less safe than the algorithm assumes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SetupWarning {
    /// The node did not answer.
    Unreachable {
        /// The node.
        node: String,
        /// The error it gave.
        error: String,
    },
    /// The node is a replica: it refuses writes, and its data is a copy of
    /// another node's, so it is not an independent vote.
    Replica {
        /// The node.
        node: String,
        /// The primary it follows.
        primary: String,
    },
    /// The node has replicas, which suggests Sentinel- or Cluster-style
    /// failover: replication is asynchronous, so a promoted replica may lack
    /// a lock its primary had granted.
    HasReplicas {
        /// The node.
        node: String,
        /// How many replicas follow it.
        replicas: u64,
    },
    /// The node keeps no append-only file while fencing tokens are in use:
    /// a restart forgets every lock (the key can be granted again at once)
    /// and the fencing counters (tokens start over and repeat).
    NoPersistence {
        /// The node.
        node: String,
    },
    /// The node deletes keys once its memory limit is reached (a
    /// `maxmemory` with a policy other than `noeviction`): a `volatile-*`
    /// policy can delete a held lock's key (every lock key has a TTL), so
    /// another client is granted the lock while its holder still believes
    /// it holds it; an `allkeys-*` policy can also delete a fencing counter,
    /// and tokens start over. Use `maxmemory-policy noeviction` (writes then
    /// fail with `OOM` at the limit, a permanent error), or a server of its
    /// own for locks.
    Evicts {
        /// The node.
        node: String,
        /// Its `maxmemory-policy`.
        policy: String,
    },
    /// Two configured nodes are the same server process (same `run_id`), so
    /// one server casts two votes.
    SameServer {
        /// One node.
        first: String,
        /// The other node.
        second: String,
        /// The shared `run_id`.
        run_id: String,
    },
}

impl fmt::Display for SetupWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unreachable { node, error } => write!(f, "node {node} is unreachable: {error}"),
            Self::Replica { node, primary } => {
                write!(
                    f,
                    "node {node} is a replica of {primary}, not an independent primary"
                )
            }
            Self::HasReplicas { node, replicas } => write!(
                f,
                "node {node} has {replicas} replica(s): a failover may promote one that lacks a granted lock"
            ),
            Self::NoPersistence { node } => write!(
                f,
                "node {node} has no append-only file while fencing is on: a restart grants held locks again and repeats fencing tokens (use appendonly yes, appendfsync always)"
            ),
            Self::Evicts { node, policy } => write!(
                f,
                "node {node} evicts keys at its memory limit (maxmemory-policy {policy}): a held lock's key, or a fencing counter, can be deleted (use maxmemory-policy noeviction)"
            ),
            Self::SameServer {
                first,
                second,
                run_id,
            } => write!(
                f,
                "nodes {first} and {second} are the same server (run_id {run_id})"
            ),
        }
    }
}

/// The result of checking a Redis deployment: what every node said and what
/// is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SetupReport {
    /// One entry per configured node, in order.
    pub nodes: Vec<NodeStatus>,
    /// Everything that weakens the lock's guarantee; empty when sound.
    pub warnings: Vec<SetupWarning>,
}

impl SetupReport {
    /// `true` when every node answered as an independent primary without
    /// replicas that does not evict keys (and, with fencing, keeps an
    /// append-only file): no warning.
    pub fn is_sound(&self) -> bool {
        self.warnings.is_empty()
    }

    /// How many nodes answered.
    pub fn reachable(&self) -> usize {
        self.nodes.iter().filter(|n| n.error.is_none()).count()
    }
}

/// Asks every node (concurrently, each within `within`) and logs every
/// warning at `WARN`; `fencing`: whether the caller issues fencing tokens
/// (which need persistence). Costs 1 round trip per node.
pub(crate) async fn inspect(nodes: &[Node], within: Duration, fencing: bool) -> SetupReport {
    let nodes = join_all(nodes.iter().map(|node| status(node, within))).await;
    let warnings = warnings(&nodes, fencing);
    for warning in &warnings {
        tracing::warn!(%warning, "distlock: unsafe Redis setup");
    }
    SetupReport { nodes, warnings }
}

impl NodeStatus {
    /// A node about which nothing is known yet.
    fn unknown(label: &str) -> Self {
        NodeStatus {
            node: label.to_owned(),
            run_id: None,
            role: None,
            primary: None,
            connected_replicas: 0,
            append_only: None,
            max_memory: None,
            eviction_policy: None,
            error: None,
        }
    }
}

async fn status(node: &Node, within: Duration) -> NodeStatus {
    let mut status = NodeStatus::unknown(node.label());
    // Plain `INFO` (default sections) works on every server version;
    // `INFO server replication` needs 7.0.
    match node.query::<String>(&redis::cmd("INFO"), within).await {
        Ok(text) => fill(&mut status, &text),
        Err(err) => status.error = Some(err.to_string()),
    }
    status
}

fn fill(status: &mut NodeStatus, info: &str) {
    let field = |name: &str| {
        info.lines()
            .find_map(|line| line.trim_end().strip_prefix(name)?.strip_prefix(':'))
            .map(str::to_owned)
    };
    status.run_id = field("run_id");
    status.role = field("role");
    if status.role.as_deref() == Some("slave") {
        let host = field("master_host").unwrap_or_default();
        let port = field("master_port").unwrap_or_default();
        status.primary = Some(format!("{host}:{port}"));
    }
    status.connected_replicas = field("connected_slaves")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    status.append_only = field("aof_enabled").map(|v| v == "1");
    status.max_memory = field("maxmemory").and_then(|n| n.parse().ok());
    status.eviction_policy = field("maxmemory_policy");
}

fn warnings(nodes: &[NodeStatus], fencing: bool) -> Vec<SetupWarning> {
    let mut warnings = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        if fencing && node.append_only == Some(false) {
            warnings.push(SetupWarning::NoPersistence {
                node: node.node.clone(),
            });
        }
        if let (Some(1..), Some(policy)) = (node.max_memory, &node.eviction_policy)
            && policy != "noeviction"
        {
            warnings.push(SetupWarning::Evicts {
                node: node.node.clone(),
                policy: policy.clone(),
            });
        }
        if let Some(error) = &node.error {
            warnings.push(SetupWarning::Unreachable {
                node: node.node.clone(),
                error: error.clone(),
            });
        }
        if let Some(primary) = &node.primary {
            warnings.push(SetupWarning::Replica {
                node: node.node.clone(),
                primary: primary.clone(),
            });
        }
        if node.connected_replicas > 0 {
            warnings.push(SetupWarning::HasReplicas {
                node: node.node.clone(),
                replicas: node.connected_replicas,
            });
        }
        let twin = nodes[..i]
            .iter()
            .find(|other| other.run_id.is_some() && other.run_id == node.run_id);
        if let (Some(twin), Some(run_id)) = (twin, &node.run_id) {
            warnings.push(SetupWarning::SameServer {
                first: twin.node.clone(),
                second: node.node.clone(),
                run_id: run_id.clone(),
            });
        }
    }
    warnings
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(info: &str) -> NodeStatus {
        let mut status = NodeStatus::unknown("n");
        fill(&mut status, info);
        status
    }

    #[test]
    fn parses_a_replica() {
        let status = parsed(
            "# Server\r\nrun_id:abc\r\n# Replication\r\nrole:slave\r\nmaster_host:127.0.0.1\r\nmaster_port:7001\r\n",
        );
        assert_eq!(status.run_id.as_deref(), Some("abc"));
        assert_eq!(status.primary.as_deref(), Some("127.0.0.1:7001"));
        assert_eq!(warnings(&[status], false).len(), 1);
    }

    #[test]
    fn flags_a_server_that_evicts_keys_at_a_memory_limit() {
        let evicts = |info: &str| {
            matches!(
                warnings(&[parsed(info)], false).as_slice(),
                [SetupWarning::Evicts { policy, .. }] if policy == "volatile-lru"
            )
        };
        assert!(evicts(
            "maxmemory:4194304\r\nmaxmemory_policy:volatile-lru\r\nrole:master\r\n"
        ));
        // No limit: nothing is ever evicted, whatever the policy says.
        assert!(!evicts(
            "maxmemory:0\r\nmaxmemory_policy:volatile-lru\r\nrole:master\r\n"
        ));
        let kept = parsed("maxmemory:4194304\r\nmaxmemory_policy:noeviction\r\nrole:master\r\n");
        assert!(warnings(&[kept], false).is_empty());
    }

    #[test]
    fn flags_a_server_without_append_only_file_only_when_fencing() {
        let status = parsed("# Persistence\r\naof_enabled:0\r\n# Replication\r\nrole:master\r\n");
        assert_eq!(status.append_only, Some(false));
        assert!(warnings(std::slice::from_ref(&status), false).is_empty());
        assert!(matches!(
            warnings(&[status], true).as_slice(),
            [SetupWarning::NoPersistence { .. }]
        ));
        let durable = parsed("aof_enabled:1\r\nrole:master\r\n");
        assert!(warnings(&[durable], true).is_empty());
    }

    #[test]
    fn flags_the_same_server_twice() {
        let a = parsed("run_id:abc\r\nrole:master\r\nconnected_slaves:0\r\n");
        let found = warnings(&[a.clone(), a], false);
        assert!(matches!(
            found.as_slice(),
            [SetupWarning::SameServer { .. }]
        ));
    }
}
