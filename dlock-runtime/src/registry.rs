//! The process-wide registry that maps backend names to backends.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, Weak};

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
    /// Bumped (under the write lock) on every change, so a [`BackendSlot`]
    /// can tell whether what it remembers is still current.
    generation: AtomicU64,
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
        let mut backends = self
            .backends
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        self.generation.fetch_add(1, Ordering::Release);
        backends.insert(name.into(), backend)
    }

    /// Removes the backend registered under `name`.
    pub fn unregister(&self, name: &str) -> Option<Arc<dyn Backend>> {
        let mut backends = self
            .backends
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        self.generation.fetch_add(1, Ordering::Release);
        backends.remove(name)
    }

    /// The backend registered under `name`.
    pub fn get(&self, name: &str) -> Result<Arc<dyn Backend>, LockError> {
        self.get_current(name).map(|(_, backend)| backend)
    }

    /// [`Registry::get`] and the generation it was read at.
    fn get_current(&self, name: &str) -> Result<(u64, Arc<dyn Backend>), LockError> {
        let backends = self.backends.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(backend) = backends.get(name) {
            // Changes bump the generation under the write lock, so it cannot
            // move while this read lock is held.
            let generation = self.generation.load(Ordering::Acquire);
            return Ok((generation, Arc::clone(backend)));
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

    /// Sets the application label every acquisition in this process
    /// records beside the lock with its host and pid (see
    /// [`crate::holder`]), or clears it with `None`. A backend that carries
    /// a label of its own records that one instead. Refused
    /// ([`LockError::InvalidOption`]) if longer than
    /// [`MAX_LABEL_LEN`](crate::holder::MAX_LABEL_LEN) bytes, empty, or
    /// with a control character.
    ///
    /// ```
    /// dlock_runtime::registry().set_label(Some("billing"))?;
    /// # dlock_runtime::registry().set_label(None)?;
    /// # Ok::<(), dlock_runtime::LockError>(())
    /// ```
    pub fn set_label(&self, label: Option<&str>) -> Result<(), LockError> {
        crate::holder::set_process_label(label)
    }

    /// The label [`Registry::set_label`] set, if any.
    pub fn label(&self) -> Option<String> {
        crate::holder::process_label().map(|label| label.to_string())
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

/// One call site's memory of the backend it names, for code that knows the
/// name at compile time (`#[distributed_lock]` expansions): a call looks the
/// name up in the registry only when the registry changed since the last
/// call, instead of hashing the name and searching the map every time.
/// Registering, replacing or removing any backend takes effect at the next
/// call exactly as with [`Registry::get`].
#[doc(hidden)]
pub struct BackendSlot {
    name: &'static str,
    /// Weak, so that a backend that was unregistered and let go of is not
    /// kept alive (with its connections) by a call site that remembers it.
    remembered: RwLock<Option<(u64, Weak<dyn Backend>)>>,
}

impl BackendSlot {
    /// A slot for the backend registered under `name`, empty until first used.
    pub const fn new(name: &'static str) -> Self {
        Self {
            name,
            remembered: RwLock::new(None),
        }
    }

    /// The backend currently registered under the slot's name, in
    /// [`registry`].
    pub fn get(&self) -> Result<Arc<dyn Backend>, LockError> {
        let registry = registry();
        let current = registry.generation.load(Ordering::Acquire);
        if let Some((generation, backend)) = &*self
            .remembered
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            && *generation == current
            && let Some(backend) = backend.upgrade()
        {
            return Ok(backend);
        }
        let (generation, backend) = registry.get_current(self.name)?;
        *self
            .remembered
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some((generation, Arc::downgrade(&backend)));
        Ok(backend)
    }
}

impl fmt::Debug for BackendSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendSlot")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}
