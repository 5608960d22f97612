/*
 * The official RocketMQ 5 Java client's transactional producer, as its example uses it
 * (ClientServiceProvider, a Producer with a TransactionChecker, beginTransaction, send,
 * commit/rollback), pointed at `rmqtx serve`. Used by bench/java_client_bench.py.
 *
 * Usage: java -cp <client jar>:. TransactionalProducer ENDPOINTS TOPIC ACCESS_KEY SECRET_KEY
 *            COUNT SENDERS OPEN_WAIT_SECONDS [WARMUP]
 *
 * WARMUP (default 0) transactions (keys "warmup-<i>", committed) are sent first by the same
 * SENDERS threads and not counted: JIT, TLS handshakes and route lookups out of the figures.
 * Sends COUNT transactional messages (keys "commit-<i>") from SENDERS threads, each committed
 * after its send; then one rolled back ("rollback-0") and one left open ("open-0"), which the
 * server asks this producer's checker about over the telemetry stream (the checker answers
 * COMMIT for "commit-" and "open-" keys, ROLLBACK otherwise). Waits OPEN_WAIT_SECONDS for that
 * check, then prints one JSON line: sends, errors, seconds, send+commit latencies (ms) and the
 * keys the checker was asked about.
 */

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.atomic.AtomicInteger;
import org.apache.rocketmq.client.apis.ClientConfiguration;
import org.apache.rocketmq.client.apis.ClientServiceProvider;
import org.apache.rocketmq.client.apis.StaticSessionCredentialsProvider;
import org.apache.rocketmq.client.apis.message.Message;
import org.apache.rocketmq.client.apis.producer.Producer;
import org.apache.rocketmq.client.apis.producer.Transaction;
import org.apache.rocketmq.client.apis.producer.TransactionChecker;
import org.apache.rocketmq.client.apis.producer.TransactionResolution;

public final class TransactionalProducer {
    private TransactionalProducer() {
    }

    public static void main(String[] args) {
        // The client's threads are not daemons: any failure must end the JVM, not leave it hanging.
        int status = 0;
        try {
            run(args);
        } catch (Throwable e) {
            e.printStackTrace();
            status = 2;
        }
        System.exit(status);
    }

    private static void run(String[] args) throws Exception {
        String endpoints = args[0];
        String topic = args[1];
        int count = Integer.parseInt(args[4]);
        int senders = Integer.parseInt(args[5]);
        long openWait = Long.parseLong(args[6]);
        int warmup = args.length > 7 ? Integer.parseInt(args[7]) : 0;
        ClientServiceProvider provider = ClientServiceProvider.loadService();
        ClientConfiguration configuration = ClientConfiguration.newBuilder()
            .setEndpoints(endpoints)
            .setCredentialProvider(new StaticSessionCredentialsProvider(args[2], args[3]))
            .build();
        ConcurrentLinkedQueue<String> checked = new ConcurrentLinkedQueue<>();
        TransactionChecker checker = view -> {
            String key = view.getKeys().isEmpty() ? "" : view.getKeys().iterator().next();
            checked.add(key);
            return key.startsWith("commit-") || key.startsWith("open-") || key.startsWith("warmup-")
                ? TransactionResolution.COMMIT : TransactionResolution.ROLLBACK;
        };
        Producer producer = provider.newProducerBuilder()
            .setClientConfiguration(configuration)
            .setTopics(topic)
            .setTransactionChecker(checker)
            .build();
        List<Double> latencies = Collections.synchronizedList(new ArrayList<>());
        AtomicInteger errors = new AtomicInteger();
        double seconds;
        try {
            if (warmup > 0) {
                sendAll(producer, provider, topic, "warmup-", warmup, senders,
                    Collections.synchronizedList(new ArrayList<>()), new AtomicInteger());
            }
            long start = System.nanoTime();
            sendAll(producer, provider, topic, "commit-", count, senders, latencies, errors);
            seconds = (System.nanoTime() - start) / 1e9;
            Transaction rolledBack = producer.beginTransaction();
            producer.send(message(provider, topic, "rollback-0"), rolledBack);
            rolledBack.rollback();
            producer.send(message(provider, topic, "open-0"), producer.beginTransaction());
            long deadline = System.currentTimeMillis() + openWait * 1000;
            while (!checked.contains("open-0") && System.currentTimeMillis() < deadline) {
                Thread.sleep(200);
            }
            Thread.sleep(1000); // the checker's answer travels back as an EndTransaction
        } finally {
            producer.close();
        }
        StringBuilder out = new StringBuilder();
        out.append("{\"sends\": ").append(latencies.size())
            .append(", \"errors\": ").append(errors.get())
            .append(", \"seconds\": ").append(seconds)
            .append(", \"checked\": [");
        List<String> keys = new ArrayList<>(checked);
        for (int i = 0; i < keys.size(); i++) {
            out.append(i > 0 ? ", " : "").append('"').append(keys.get(i)).append('"');
        }
        out.append("], \"latencies_ms\": ").append(latencies).append("}");
        System.out.println(out);
    }

    /** COUNT transactions from SENDERS threads, each sent and committed; returns when all are. */
    private static void sendAll(Producer producer, ClientServiceProvider provider, String topic,
                                String prefix, int count, int senders, List<Double> latencies,
                                AtomicInteger errors) throws InterruptedException {
        AtomicInteger next = new AtomicInteger();
        List<Thread> threads = new ArrayList<>();
        for (int s = 0; s < senders; s++) {
            Thread thread = new Thread(() -> {
                for (int i = next.getAndIncrement(); i < count; i = next.getAndIncrement()) {
                    long t0 = System.nanoTime();
                    try {
                        Transaction transaction = producer.beginTransaction();
                        producer.send(message(provider, topic, prefix + i), transaction);
                        transaction.commit();
                        latencies.add((System.nanoTime() - t0) / 1e6);
                    } catch (Exception e) {
                        errors.incrementAndGet();
                        System.err.println("send " + prefix + i + " failed: " + e);
                    }
                }
            });
            thread.start();
            threads.add(thread);
        }
        for (Thread thread : threads) {
            thread.join();
        }
    }

    private static Message message(ClientServiceProvider provider, String topic, String key) {
        return provider.newMessageBuilder()
            .setTopic(topic)
            .setTag("bench")
            .setKeys(key)
            .setBody(("body of " + key).getBytes(StandardCharsets.UTF_8))
            .build();
    }
}
