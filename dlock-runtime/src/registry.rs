//! The process-wide registry that maps backend names to backends.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, PoisonError, RwLock};

use once_cell::sync::Lazy;

use crate::backend::Backend;
use crate::error::LockError;

/// The name a lock uses when it names no backend.
pub const DEFAULT_BACKEND: &str = "default";

/// Named backends, shared by every lock in the process.
///
/// Nothing is registered until the application registers it: a lock whose
/// backend is missing fails with [`LockError::UnknownBackend`] rather than
/// silently falling back to a store other replicas cannot see.
#[derive(Default)]
pub struct Registry {
    backends: RwLock<HashMap<String, Arc<dyn Backend>>>,
}

impl Registry {
    /// Registers `backend` under `name`, replacing (and returning) any
    /// backend registered under that name before.
    ///
    /// ```
    /// use dlock_runtime::{registry, memory::MemoryBackend};
    /// registry().register("doc-example", MemoryBackend::new());
    /// assert!(registry().get("doc-example").is_ok());
    /// assert!(registry().get("never-registered").is_err());
    /// ```
    pub fn register(
        &self,
        name: impl Into<String>,
        backend: impl Backend + 'static,
    ) -> Option<Arc<dyn Backend>> {
        self.register_shared(name, Arc::new(backend))
    }

    /// Registers a backend that is already shared, for example one backend
    /// under two names.
    pub fn register_shared(
        &self,
        name: impl Into<String>,
        backend: Arc<dyn Backend>,
    ) -> Option<Arc<dyn Backend>> {
        self.backends
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name.into(), backend)
    }

    /// Removes the backend registered under `name`.
    pub fn unregister(&self, name: &str) -> Option<Arc<dyn Backend>> {
        self.backends
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name)
    }

    /// The backend registered under `name`.
    pub fn get(&self, name: &str) -> Result<Arc<dyn Backend>, LockError> {
        let backends = self.backends.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(backend) = backends.get(name) {
            return Ok(Arc::clone(backend));
        }
        let mut names: Vec<&str> = backends.keys().map(String::as_str).collect();
        names.sort_unstable();
        Err(LockError::UnknownBackend {
            name: name.to_owned(),
            registered: if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(", ")
            },
        })
    }

    /// The registered names, sorted.
    pub fn names(&self) -> Vec<String> {
        let backends = self.backends.read().unwrap_or_else(PoisonError::into_inner);
        let mut names: Vec<String> = backends.keys().cloned().collect();
        names.sort_unstable();
        names
    }
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("names", &self.names())
            .finish()
    }
}

static REGISTRY: Lazy<Registry> = Lazy::new(Registry::default);

/// The process-wide registry every `#[distributed_lock]` looks backends up in.
pub fn registry() -> &'static Registry {
    &REGISTRY
}
