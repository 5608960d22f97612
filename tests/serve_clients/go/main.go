// The Go client's own transactional-producer example (example/producer/transaction/main.go of
// github.com/apache/rocketmq-clients/golang/v5 v5.1.4), unchanged but for where it sends: the
// endpoint, topic and account come from RMQTX_ENDPOINT, RMQTX_TOPIC, RMQTX_ACCESS_KEY and
// RMQTX_SECRET_KEY. Its defaults stay (TLS on, the server's certificate not verified).
//
// Usage:
//
//	go-client example N   the example with N transactions, each committed
//	go-client open        one transaction left open until the client's checker is asked
//	                      about it (it answers COMMIT)
//	go-client push N      the client's push-consumer example (example/consumer/
//	                      push_consumer) as consumer group RMQTX_GROUP, until it consumed
//	                      N messages or 60 s passed
//	go-client simple N    its simple-consumer example, the same way
//
// Each send prints {"sent": "<message id>", "transaction": "<id>"}, each check
// {"checked": "<message id>"} and each message consumed {"consumed": "<message id>", "body":
// "...", "attempt": "<n>"}, one JSON object a line, on stdout.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"strconv"
	"time"

	rmq_client "github.com/apache/rocketmq-clients/golang/v5"
	"github.com/apache/rocketmq-clients/golang/v5/credentials"
)

var (
	Topic     = os.Getenv("RMQTX_TOPIC")
	Group     = os.Getenv("RMQTX_GROUP")
	Endpoint  = os.Getenv("RMQTX_ENDPOINT")
	AccessKey = os.Getenv("RMQTX_ACCESS_KEY")
	SecretKey = os.Getenv("RMQTX_SECRET_KEY")
)

func report(fields map[string]string) {
	line, _ := json.Marshal(fields)
	fmt.Println(string(line))
}

func main() {
	mode := os.Args[1]
	checked := make(chan string, 16)
	// log to console
	os.Setenv("mq.consoleAppender.enabled", "true")
	rmq_client.ResetLogger()
	if mode == "push" || mode == "simple" {
		want, _ := strconv.Atoi(os.Args[2])
		consume(mode, want)
		return
	}
	// In most case, you don't need to create many producers, singleton pattern is more recommended.
	producer, err := rmq_client.NewProducer(&rmq_client.Config{
		Endpoint: Endpoint,
		Credentials: &credentials.SessionCredentials{
			AccessKey:    AccessKey,
			AccessSecret: SecretKey,
		},
	},
		rmq_client.WithTransactionChecker(&rmq_client.TransactionChecker{
			Check: func(msg *rmq_client.MessageView) rmq_client.TransactionResolution {
				log.Printf("check transaction message: %v", msg)
				checked <- msg.GetMessageId()
				return rmq_client.COMMIT
			},
		}),
		rmq_client.WithTopics(Topic),
	)
	if err != nil {
		log.Fatal(err)
	}
	// start producer
	err = producer.Start()
	if err != nil {
		log.Fatal(err)
	}
	// graceful stop producer
	defer producer.GracefulStop()
	count := 1
	if mode == "example" {
		count, _ = strconv.Atoi(os.Args[2])
	}
	for i := 0; i < count; i++ {
		// new a message
		msg := &rmq_client.Message{
			Topic: Topic,
			Body:  []byte("this is a message : " + strconv.Itoa(i)),
		}
		// set keys and tag
		msg.SetKeys("a", "b")
		msg.SetTag("ab")
		// send message in sync
		transaction := producer.BeginTransaction()
		resp, err := producer.SendWithTransaction(context.TODO(), msg, transaction)
		if err != nil {
			log.Fatal(err)
		}
		for i := 0; i < len(resp); i++ {
			report(map[string]string{"sent": resp[i].MessageID, "transaction": resp[i].TransactionId})
		}
		if mode == "open" {
			// left open: the server asks the checker about it
			select {
			case id := <-checked:
				time.Sleep(time.Second) // its answer is sent after Check returns
				report(map[string]string{"checked": id})
			case <-time.After(90 * time.Second):
				log.Fatal("the checker was not asked within 90 s")
			}
			return
		}
		// commit transaction message
		err = transaction.Commit()
		if err != nil {
			log.Fatal(err)
		}
		// wait a moment
		time.Sleep(time.Second * 1)
	}
}

func consumed(mv *rmq_client.MessageView) {
	report(map[string]string{
		"consumed": mv.GetMessageId(),
		"body":     string(mv.GetBody()),
		"attempt":  strconv.Itoa(int(mv.GetDeliveryAttempt())),
	})
}

// consume runs the client's push- or simple-consumer example as group Group on Topic until
// want messages were consumed or 60 s passed.
func consume(mode string, want int) {
	config := &rmq_client.Config{
		Endpoint:      Endpoint,
		ConsumerGroup: Group,
		Credentials: &credentials.SessionCredentials{
			AccessKey:    AccessKey,
			AccessSecret: SecretKey,
		},
	}
	subscription := map[string]*rmq_client.FilterExpression{Topic: rmq_client.SUB_ALL}
	done := make(chan *rmq_client.MessageView, 1024)
	deadline := time.After(60 * time.Second)
	if mode == "push" {
		pushConsumer, err := rmq_client.NewPushConsumer(config,
			rmq_client.WithPushAwaitDuration(time.Second*5),
			rmq_client.WithPushSubscriptionExpressions(subscription),
			rmq_client.WithPushMessageListener(&rmq_client.FuncMessageListener{
				Consume: func(mv *rmq_client.MessageView) rmq_client.ConsumerResult {
					done <- mv
					// ack message
					return rmq_client.SUCCESS
				},
			}),
			rmq_client.WithPushConsumptionThreadCount(20),
			rmq_client.WithPushMaxCacheMessageCount(1024),
		)
		if err != nil {
			log.Fatal(err)
		}
		if err = pushConsumer.Start(); err != nil {
			log.Fatal(err)
		}
		defer pushConsumer.GracefulStop()
	} else {
		simpleConsumer, err := rmq_client.NewSimpleConsumer(config,
			rmq_client.WithSimpleAwaitDuration(time.Second*5),
			rmq_client.WithSimpleSubscriptionExpressions(subscription),
		)
		if err != nil {
			log.Fatal(err)
		}
		if err = simpleConsumer.Start(); err != nil {
			log.Fatal(err)
		}
		defer simpleConsumer.GracefulStop()
		go func() {
			for {
				mvs, err := simpleConsumer.Receive(context.TODO(), 16, time.Second*20)
				if err != nil {
					log.Println(err)
				}
				// ack message
				for _, mv := range mvs {
					if err := simpleConsumer.Ack(context.TODO(), mv); err != nil {
						log.Fatal(err)
					}
					done <- mv
				}
			}
		}()
	}
	for count := 0; count < want; count++ {
		select {
		case mv := <-done:
			consumed(mv)
		case <-deadline:
			log.Printf("consumed %d of %d messages in 60 s", count, want)
			return
		}
	}
	time.Sleep(time.Second) // the last acknowledgement is sent after Consume returns
}
