#![deny(warnings)]

use dlock::{FencingToken, LockError, distributed_lock};

struct Account {
    id: u64,
    balance: i64,
}

impl Account {
    #[distributed_lock(key = "account:{self.id}", ttl = "30s")]
    async fn balance(&self) -> Result<i64, LockError> {
        Ok(self.balance)
    }

    #[distributed_lock(key = "account:{self.id}", ttl = "30s")]
    pub async fn deposit(
        &mut self,
        amount: i64,
        token: FencingToken,
    ) -> Result<FencingToken, LockError> {
        self.balance += amount;
        Ok(token)
    }

    #[distributed_lock(key = "account:{self.id}:close", ttl = "30s")]
    async fn close(self) -> Result<i64, LockError> {
        Ok(self.balance)
    }

    #[distributed_lock(key = "account:{self.id}", ttl = "30s")]
    async fn owner_of(&self, names: &[&'static str]) -> Result<&'static str, LockError> {
        Ok(names[0])
    }

    #[distributed_lock(key = "account:{self.id}", ttl = "30s")]
    async fn id_text(&self) -> Result<&str, LockError> {
        Ok(if self.id == 1 { "one" } else { "other" })
    }

    #[distributed_lock(key = "account:{self.id}", ttl = "30s")]
    async fn copy(&self) -> Result<Self, LockError> {
        Ok(Self {
            id: self.id,
            balance: self.balance,
        })
    }
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        let mut account = Account { id: 1, balance: 10 };
        account.deposit(5).await.expect("free key");
        assert_eq!(account.balance().await.expect("free key"), 15);
        assert_eq!(account.owner_of(&["ann"]).await.expect("free key"), "ann");
        assert_eq!(account.id_text().await.expect("free key"), "one");
        let copy = account.copy().await.expect("free key");
        assert_eq!(copy.close().await.expect("free key"), 15);
    });
}
