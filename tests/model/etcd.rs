//! etcd: one member of the run's own, three backends on it, and an
//! operator who deletes dlock's keys (the lock, whose lease then ends for
//! nothing, or the holder record beside it).

use std::sync::Arc;

use async_trait::async_trait;
use dlock::Backend;

use crate::etcd_support::{Cluster, etcdctl};
use crate::ops::{Abilities, Op, Part};
use crate::run::{Run, Store};

pub struct Etcd {
    cluster: Cluster,
    backends: Vec<Arc<dyn Backend>>,
}

impl Etcd {
    pub async fn open() -> Self {
        let cluster = Cluster::start(1);
        let mut backends: Vec<Arc<dyn Backend>> = Vec::new();
        for _ in 0..3 {
            backends.push(Arc::new(cluster.backend().await));
        }
        Self { cluster, backends }
    }
}

#[async_trait]
impl Store for Etcd {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn abilities(&self) -> Abilities {
        Abilities {
            held: true,
            named_force: true,
            deletes: vec![Part::Lock, Part::Info],
            ..Abilities::default()
        }
    }

    fn backends(&self) -> Vec<Arc<dyn Backend>> {
        self.backends.clone()
    }

    async fn fault(&self, op: &Op, run: &mut Run) -> Result<(), String> {
        let Op::Delete { k, part } = *op else {
            return Err(format!("etcd has no fault {op:?}"));
        };
        let name = match part {
            Part::Lock => format!("dlock/lock/{}", run.keys[k]),
            _ => format!("dlock/holder/{}", run.keys[k]),
        };
        let endpoint = self.cluster.endpoints()[0].clone();
        let deleted = etcdctl(&endpoint, &["del", &name])
            .ok_or_else(|| format!("etcdctl del {name} failed"))?;
        if part == Part::Lock && deleted.trim() == "1" {
            run.model.lose(k, false);
        }
        Ok(())
    }
}
